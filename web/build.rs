// The browser's suspending reads (src/jspi.rs, js/jspi.js) switch Rust's shadow stack pointer
// around each suspension, so the wasm module exports it.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("wasm32") {
        println!("cargo:rustc-cdylib-link-arg=--export=__stack_pointer");
    }
}
