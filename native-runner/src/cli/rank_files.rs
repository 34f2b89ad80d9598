//! `--model-files`/`--optim-files` for the commands that read a checkpoint folder (`inspect`,
//! `verify`, `diff`): the per-rank sets to read, as `{r}` patterns, instead of the sets found by
//! name (`shardscope_runner::fsdp1_local` says how names are grouped).

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use shardscope_core::index::{self, CheckpointIndex};

use crate::input::Input;

#[derive(Debug, Clone, Default, Args)]
pub struct RankFileArgs {
    /// Per-rank files: file-name pattern of the model files, `{r}` for the rank
    /// (`ckpt_{r}_model.pt`); only the named sets are read (default: every set found by name).
    #[arg(long, value_name = "PATTERN")]
    pub model_files: Option<String>,
    /// Per-rank files: file-name pattern of the optimizer files, `{r}` for the rank.
    #[arg(long, value_name = "PATTERN")]
    pub optim_files: Option<String>,
}

impl RankFileArgs {
    fn given(&self) -> bool {
        self.model_files.is_some() || self.optim_files.is_some()
    }

    /// Opens and indexes the checkpoint at `paths`: with patterns, the named per-rank sets of the
    /// one local folder given; without, as [`crate::input::open`] and `index_source` read it.
    pub fn open(
        &self,
        paths: &[PathBuf],
        progress: bool,
        label: &str,
    ) -> anyhow::Result<(Input, CheckpointIndex)> {
        if !self.given() {
            let source = crate::input::open(paths, progress)?;
            let idx =
                index::index_source(&source).with_context(|| format!("cannot read {label}"))?;
            return Ok((source, idx));
        }
        let [dir] = paths else {
            bail!(
                "{label}: --model-files/--optim-files name files of one folder; give the folder alone"
            );
        };
        if crate::input::as_url(dir).is_some() || !dir.is_dir() {
            bail!(
                "{}: --model-files/--optim-files name per-rank files in a local folder; this is not one",
                dir.display()
            );
        }
        let files = shardscope_runner::fsdp1_local::find_rank_files(
            dir,
            self.model_files.as_deref(),
            self.optim_files.as_deref(),
        )?;
        crate::convert::open_rank_files(&files)
    }
}
