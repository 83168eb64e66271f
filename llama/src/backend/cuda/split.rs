//! [`SplitTarget`] for the CUDA backend: a share of a split matmul's output columns placed
//! into the full activations (`crate::hybrid`), one row at a time with the existing copy and
//! add kernels (a split pass has few rows: the planner gives a prefill chunk no CPU share).

use crate::backend::{BackendError, NormInto};
use crate::hybrid::SplitTarget;

use super::device::{dtype_code, elementwise};
use super::{CudaBackend, CudaBuf};

impl SplitTarget for CudaBackend {
    fn write_columns(
        &self,
        src: &CudaBuf,
        rows: usize,
        src_cols: usize,
        dst: &mut CudaBuf,
        dst_cols: usize,
        col0: usize,
        into: NormInto,
    ) -> Result<(), BackendError> {
        if col0 + src_cols > dst_cols
            || src.0.len() < rows * src_cols
            || dst.0.len() < rows * dst_cols
        {
            return Err(BackendError::Unsupported {
                op: "cuda write_columns",
                message: format!(
                    "columns {col0}..{} of {rows} rows of {dst_cols} from {src_cols} (buffers \
                     of {} and {} values)",
                    col0 + src_cols,
                    src.0.len(),
                    dst.0.len()
                ),
            });
        }
        if src_cols == 0 {
            return Ok(());
        }
        self.graphs
            .forbid_while_recording("a split matmul's columns")?;
        for r in 0..rows {
            let from = self.addr(src, r * src_cols);
            let to = self.addr(dst, r * dst_cols + col0);
            match into {
                NormInto::Write => {
                    self.copy_launch(&self.kernels.copy_f32, from, to, src_cols)?;
                }
                NormInto::Add => {
                    // `to[i] += from[i % width]` with the width of the whole row: an add.
                    let (dtype, width, n) = (
                        dtype_code(weights_format::DType::F32),
                        src_cols as i32,
                        src_cols as u64,
                    );
                    let mut b = self
                        .queue
                        .kernel(&self.kernels.add_bias, "split add kernel");
                    b.arg(&to).arg(&from).arg(&dtype).arg(&width).arg(&n);
                    // SAFETY: `to` addresses src_cols values of row r of dst (checked above
                    // to hold rows·dst_cols values, col0 + src_cols <= dst_cols) and `from`
                    // src_cols f32 values of row r of src (rows·src_cols values).
                    unsafe { b.run(elementwise(src_cols)) }?;
                }
            }
        }
        Ok(())
    }
}
