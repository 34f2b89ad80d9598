//! HF-style exports against real torch: runs `tests/interop/check_export.py`, which checks that
//! `convert --dtype` equals torch's `Tensor.to(dtype)` bit for bit (random, subnormal, halfway,
//! overflowing, NaN and inf values), that a tied model exports to safetensors once and loads with
//! `safetensors.torch.load_model` (from `torch.save` and from DCP; `--keep-tied` keeps both), and
//! that `layout --from` a tied DCP gives the flat parameters FSDP1 builds.

#[test]
fn dtype_casts_and_tied_exports_match_torch() {
    crate::common::run_interop_script("check_export.py");
}
