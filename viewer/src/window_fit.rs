//! The desktop window's size at start.

/// The desktop window fills the screen it opens on (`shardscope-viewer` turns it on: `Viewer::window_fit`): it asks
/// the window manager to maximize it; where none does (no window manager, or one that ignores the
/// request), it sets the window to the monitor's size at its top-left corner itself. Whatever the
/// screen, the window never opens larger than it.
#[derive(Debug, Default)]
pub enum WindowFit {
    /// Left as it opened (tests, the browser).
    #[default]
    Off,
    /// Maximize on the next frame that knows its monitor.
    Start,
    /// Maximize was asked for at this time; checked a moment later.
    Asked(std::time::Instant),
    Done,
}

#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
impl WindowFit {
    /// How long a window manager is given to maximize the window.
    const GRACE: std::time::Duration = std::time::Duration::from_millis(500);

    pub(crate) fn step(&mut self, ctx: &egui::Context) {
        let (monitor, maximized) = ctx.input(|i| {
            let v = i.viewport();
            (v.monitor_size, v.maximized.unwrap_or(false))
        });
        match *self {
            WindowFit::Off | WindowFit::Done => {}
            WindowFit::Start => {
                if monitor.is_some() {
                    ctx.send_viewport_cmd(egui::ViewportCommand::Maximized(true));
                    *self = WindowFit::Asked(std::time::Instant::now());
                }
                ctx.request_repaint_after(Self::GRACE);
            }
            WindowFit::Asked(at) if at.elapsed() < Self::GRACE => {
                ctx.request_repaint_after(Self::GRACE);
            }
            WindowFit::Asked(_) => {
                if !maximized && let Some(size) = monitor {
                    ctx.send_viewport_cmd(egui::ViewportCommand::OuterPosition(egui::Pos2::ZERO));
                    ctx.send_viewport_cmd(egui::ViewportCommand::InnerSize(size));
                }
                *self = WindowFit::Done;
            }
        }
    }
}
