//! The interop scripts' rank launcher (`tests/interop/ranks.py`) tolerates a gloo rank that aborts
//! at teardown after writing its results, and fails when a rank aborts or raises during its work.

#[test]
fn rank_launcher_judges_by_results_not_teardown() {
    crate::common::run_interop_script("check_ranks.py");
}
