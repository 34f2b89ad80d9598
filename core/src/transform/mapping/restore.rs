//! `drop` + `restore`: a stored tensor the other side has no place for, left out on the way
//! forward and written back as zeros on the way back (torchtitan gpt_oss's `expert_bias_E`).

use super::expr::Config;
use super::{DType, MappingError, MappingFile, Pattern, Plan, Planned, Recipe, eval_shape};

/// Whether `name` (a stored name the way forward drops) is one a `restore` rule writes back as
/// zeros: a buffer the other side has no place for, whose non-zero values are lost.
pub fn restored_as_zeros(file: &MappingFile, name: &str) -> bool {
    file.rules.iter().any(|r| {
        r.restore.is_some() && Pattern::parse(&r.from).is_ok_and(|p| p.matches(name).is_some())
    })
}

/// The way back: the zeros each `drop` + `restore` rule writes beside the outputs it names.
pub(super) fn restore_dropped(
    file: &MappingFile,
    config: &Config,
    plan: &mut Plan,
) -> Result<(), MappingError> {
    for spec in &file.rules {
        let (Some(restore), Some(shape)) = (&spec.restore, &spec.shape) else {
            continue;
        };
        let from = Pattern::parse(&spec.from)?;
        let beside = Pattern::parse(&restore.beside)?;
        let dtype: DType = restore.zeros.parse().map_err(|_| {
            MappingError::Spec(format!("`restore`: `{}` is not a dtype", restore.zeros))
        })?;
        let mut made = Vec::new();
        for o in &plan.outputs {
            let Some(caps) = beside.matches(&o.name) else {
                continue;
            };
            let name = from.fill(&caps)?;
            let shape = eval_shape(shape, config)
                .map_err(|e| MappingError::Plan(format!("{name}: {e}")))?;
            made.push(Planned {
                name,
                dtype,
                shape: shape.clone(),
                recipe: Recipe::Zeros { shape },
            });
        }
        plan.outputs.extend(made);
    }
    Ok(())
}
