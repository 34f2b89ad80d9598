//! `shardscope-viewer [FILE_OR_FOLDER ...]`: the desktop viewer. Without arguments it shows the
//! bundled example model and trace.

#[cfg(not(target_arch = "wasm32"))]
fn main() -> eframe::Result {
    let paths: Vec<std::path::PathBuf> = std::env::args_os().skip(1).map(Into::into).collect();
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
        Box::new(move |_cc| {
            let viewer = if paths.is_empty() {
                shardscope_viewer::Viewer::with_example()
            } else {
                let mut v = shardscope_viewer::Viewer::new();
                for p in paths {
                    v.open_path(p);
                }
                v
            };
            Ok(Box::new(viewer))
        }),
    )
}

#[cfg(target_arch = "wasm32")]
fn main() {}
