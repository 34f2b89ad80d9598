//! `shardscope-viewer [OPTIONS] [FILE_OR_FOLDER ...]`: the desktop viewer. Without files it shows
//! the bundled example model and trace.
//!
//! Options (all optional): `--api fsdp1|fsdp2`, `--world-size N`, `--shard-group-size K`,
//! `--strategy NAME`, `--no-orig-params`, `--select FQN`, `--light`, `--compare B` (A/B compare of the
//! one checkpoint given, A, with B: the **Compare** tab, as `shardscope diff A B`), `--config
//! CONFIG.json` (a Hugging Face config: the FQN map shows each parameter's HF name, as
//! `shardscope convert --to hf --config CONFIG.json` writes it).

#[cfg(not(target_arch = "wasm32"))]
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("hint: {USAGE}");
            std::process::ExitCode::from(2)
        }
    }
}

/// The origin shown next to a layout control set by a command-line flag.
#[cfg(not(target_arch = "wasm32"))]
const COMMAND_LINE: &str = "set on the command line";

#[cfg(not(target_arch = "wasm32"))]
const USAGE: &str = "shardscope-viewer [--api fsdp1|fsdp2] [--world-size N] [--shard-group-size S] [--strategy NAME] [--no-orig-params] [--select FQN] [--tab shard-map|ranks|checkpoint|values|compare] [--light] [--config CONFIG.json] [FILE_OR_FOLDER ...] [A --compare B]";

#[cfg(not(target_arch = "wasm32"))]
fn run() -> Result<(), String> {
    use shardscope_viewer::Viewer;

    let mut viewer = Viewer::new();
    let mut paths: Vec<std::path::PathBuf> = Vec::new();
    let mut compare: Option<std::path::PathBuf> = None;
    let mut config: Option<std::path::PathBuf> = None;
    // `--tab values`: read the values of the checkpoint opened (before the window opens).
    let mut read_values = false;
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy().into_owned();
        let mut value = |name: &str| -> Result<String, String> {
            args.next()
                .map(|v| v.to_string_lossy().into_owned())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        let number = |name: &str, v: String| -> Result<u64, String> {
            v.parse()
                .map_err(|_| format!("{name}: `{v}` is not a positive integer"))
        };
        match text.as_str() {
            "--api" => {
                viewer.controls.api = value("--api")?.parse().map_err(|e| format!("{e}"))?;
                viewer.controls.origins.api = Some(COMMAND_LINE.into());
            }
            "--world-size" => {
                viewer.controls.world_size = number("--world-size", value("--world-size")?)?;
                viewer.controls.origins.world_size = Some(COMMAND_LINE.into());
            }
            "--shard-group-size" => {
                viewer.controls.shard_group_size =
                    number("--shard-group-size", value("--shard-group-size")?)?;
                viewer.controls.origins.shard_group = Some(COMMAND_LINE.into());
            }
            "--strategy" => {
                viewer.controls.strategy =
                    value("--strategy")?.parse().map_err(|e| format!("{e}"))?;
                viewer.controls.origins.shard_group = Some(COMMAND_LINE.into());
            }
            "--no-orig-params" => viewer.controls.use_orig_params = false,
            "--select" => viewer.selection.select(value("--select")?),
            "--compare" => compare = Some(value("--compare")?.into()),
            "--config" => config = Some(std::path::PathBuf::from(value("--config")?)),
            "--tab" => {
                viewer.tab = tab(&value("--tab")?)?;
                read_values |= viewer.tab == shardscope_viewer::Tab::Values;
                viewer.stay_on_tab = true;
            }
            "--light" => viewer.theme = shardscope_viewer::theme::Theme::Light,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            _ => paths.push(arg.into()),
        }
    }
    if let Some(b) = &compare {
        let [a] = paths.as_slice() else {
            return Err("--compare B needs exactly one checkpoint A (a file or folder)".to_owned());
        };
        viewer.compare_paths(a, b);
        viewer.stay_on_tab = true;
    }
    if paths.is_empty() {
        open_example(&mut viewer);
    }
    if read_values {
        viewer.loader.synchronous = true;
    }
    for p in paths {
        viewer.open_path(p);
    }
    if let Some(path) = config {
        open_config(&mut viewer, &path)?;
    }
    if read_values {
        viewer.poll_loader();
        viewer.compute_values();
        viewer.loader.synchronous = false;
    }
    // Fills the screen it opens on (1400x860 until then, and when the screen is unknown).
    viewer.window_fit = shardscope_viewer::window_fit::WindowFit::Start;
    let options = eframe::NativeOptions {
        viewport: egui::ViewportBuilder::default()
            .with_title("shardscope")
            .with_inner_size([1400.0, 860.0])
            .with_drag_and_drop(true),
        ..Default::default()
    };
    eframe::run_native(
        "shardscope",
        options,
        Box::new(move |_cc| Ok(Box::new(viewer))),
    )
    .map_err(|e| e.to_string())
}

/// No files given: the bundled example model and trace.
#[cfg(not(target_arch = "wasm32"))]
fn open_example(viewer: &mut shardscope_viewer::Viewer) {
    viewer.open_example();
    viewer.tab = shardscope_viewer::Tab::ShardMap;
    viewer.stay_on_tab = true;
}

/// `--config CONFIG.json`: a Hugging Face config opened after the checkpoint (not one of its files).
#[cfg(not(target_arch = "wasm32"))]
fn open_config(
    viewer: &mut shardscope_viewer::Viewer,
    path: &std::path::Path,
) -> Result<(), String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("--config: cannot read {}: {e}", path.display()))?;
    viewer.loader.end_batch();
    viewer.open_bytes(path.display().to_string(), bytes);
    Ok(())
}

/// The tab `--tab NAME` names.
#[cfg(not(target_arch = "wasm32"))]
fn tab(name: &str) -> Result<shardscope_viewer::Tab, String> {
    use shardscope_viewer::Tab;
    Ok(match name {
        "shard-map" => Tab::ShardMap,
        "ranks" => Tab::Ranks,
        "checkpoint" => Tab::Checkpoint,
        "values" => Tab::Values,
        "compare" => Tab::Compare,
        other => {
            return Err(format!(
                "--tab: unknown tab `{other}` (shard-map, ranks, checkpoint, values, compare)"
            ));
        }
    })
}

#[cfg(target_arch = "wasm32")]
fn main() {}
