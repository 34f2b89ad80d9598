//! `shardscope convert` against real torch: runs `tests/interop/check_convert.py`, which writes a DCP
//! checkpoint with two FSDP2 ranks (gloo, CPU, spawned processes), converts it with the binary to
//! `torch.save`, safetensors and HF shards, and compares them with torch's own `dcp_to_torch_save`;
//! then converts a full state dict to DCP for 2 ranks (FSDP1 and FSDP2 chunking) and `dcp.load`s it
//! into a real FSDP2 model; and converts the 2-rank DCP (model + optimizer) to DCP for 3 ranks, which
//! three FSDP2 + Adam ranks load to the same state as torch's own resharding load of the original.
//! Every expected value comes from torch. Python comes from
//! `SHARDSCOPE_PYTHON`, else `~/torch-venv/bin/python`; without torch the test prints
//! "skipped: no torch" and passes (CI always has torch).

#[test]
fn convert_outputs_load_in_torch_and_match_torch_own_conversion() {
    crate::common::run_interop_script("check_convert.py");
}

/// `tests/interop/check_parallel.py`: torchrun (`--standalone --nproc-per-node 3`) launches three
/// `convert --part auto` processes for HF shards and for DCP; the results equal a single-process
/// run byte for byte, and torch reads them to the values of its own `dcp_to_torch_save`.
#[test]
fn parts_launched_by_torchrun_equal_one_run_and_load_in_torch() {
    crate::common::run_interop_script("check_parallel.py");
}

/// Nothing lost: empty dicts at any depth, empty lists and tuples, None and plain leaves of a
/// torch-written checkpoint come back from a `.pt` output as torch saved them
/// (tests/interop/check_empty_values.py).
#[test]
fn values_without_tensors_round_trip_to_pt() {
    crate::common::run_interop_script("check_empty_values.py");
}

/// An optimizer saved as `optimizer` (FSDP2 per-rank files of `{"model", "optimizer"}`) is found
/// by what it holds (`state` + `param_groups`) and written, equal to torch's full state dicts
/// (tests/interop/check_optimizer_by_content.py).
#[test]
fn an_optimizer_is_found_by_what_it_holds() {
    crate::common::run_interop_script("check_optimizer_by_content.py");
}

/// Nothing lost, as a category: every checkpoint among the fixtures that `convert` accepts goes to
/// a `.pt` whose values torch loads equal to what torch's own tools read from the source
/// (tests/interop/check_nothing_lost.py; refusals and exceptions listed there with their reasons).
#[test]
fn every_fixture_round_trips_to_pt() {
    crate::common::run_interop_script("check_nothing_lost.py");
}
