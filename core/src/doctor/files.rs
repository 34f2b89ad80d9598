//! Findings about whole files: ones that cannot be read, and ones in a layout shardscope does not
//! read.

use super::report::{Finding, Severity};
use crate::index::NonZeroPadding;

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

/// A finding for a DeepSpeed ZeRO folder that does not read as one save (`error`: the reader's
/// message, naming the file and key: a missing rank, ZeRO stages mixed, partitions the parameters
/// do not fill, a damaged file). Its files are not diagnosed one by one as loose `torch.save`
/// files: what DeepSpeed wrote is only meaningful as the whole save.
pub fn deepspeed_folder(label: &str, error: &str) -> Finding {
    Finding {
        code: "deepspeed-folder",
        severity: Severity::Error,
        keys: vec![label.to_owned()],
        message: format!(
            "{label} is a DeepSpeed ZeRO save that does not read as one checkpoint: {error}. DeepSpeed's load_checkpoint and zero_to_fp32 would fail on it too"
        ),
        fix: "copy the save again from where the run wrote it (every rank's files of one tag), and keep the files of one save in its tag folder".to_owned(),
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

/// A finding for a run of a DeepSpeed ZeRO optimizer moment's padding (`exp_avg`, `exp_avg_sq`
/// laid out like the fp32 partition) that is not zero: no gradient reaches the padding, so
/// DeepSpeed's optimizer keeps it zero, and the file was changed or damaged after the save. A
/// warning: no parameter's state reads the padding, but the other bytes of that file are suspect.
pub fn deepspeed_padding(p: &NonZeroPadding) -> Finding {
    Finding {
        code: "deepspeed-padding",
        severity: Severity::Warning,
        keys: vec![p.file.clone()],
        message: format!(
            "{}; no gradient reaches the padding, so DeepSpeed's optimizer keeps it zero: the file was changed or damaged after the save",
            p.describe()
        ),
        fix: format!(
            "copy {} again from where the run wrote it, and compare its checksum with the original",
            p.file
        ),
    }
}
