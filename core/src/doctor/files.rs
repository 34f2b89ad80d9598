//! Findings about whole files: ones that cannot be read, and ones in a layout shardscope does not
//! read.

use super::report::{Finding, Severity};

/// Findings for files that cannot be read (a truncated file, a missing `.distcp`): `coverage`.
pub fn unreadable_file(file: &str, what: &str) -> Finding {
    Finding {
        code: "coverage",
        severity: Severity::Error,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} cannot be read: {what}; the tensors it holds are lost for this checkpoint"
        ),
        fix: format!(
            "copy {file} again from where the checkpoint was written (it is cut short or damaged); `ls -l` it against the original"
        ),
    }
}

/// A finding for a file that reads but holds a layout shardscope does not read (`what`): the file
/// is not damaged, and copying it again would not help. A warning: nothing is known to be wrong,
/// but nothing in it was checked.
pub fn unsupported_file(file: &str, what: &str) -> Finding {
    Finding {
        code: "unsupported",
        severity: Severity::Warning,
        keys: vec![file.to_owned()],
        message: format!(
            "{file} is an intact archive in a layout shardscope does not read, so it could not be checked: {what}"
        ),
        fix: "save the checkpoint with torch.distributed.checkpoint (dcp.save), which shardscope reads for every placement, or convert it with torch (get_model_state_dict / get_optimizer_state_dict with full_state_dict=True)".to_owned(),
    }
}
