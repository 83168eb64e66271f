//! Scratch buffers the backend keeps for itself, reused by every layer and pass (ops are
//! stream-ordered) and grown to the largest size asked for; and the quantized activations of
//! the matmuls, with the memo that lets rmsnorm and the gated activations hand theirs to the next matmul.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};

use crate::backend::BackendError;

use super::device::{Kernels, Queue, elementwise};
use super::graph::Graphs;

/// The most activations rmsnorm and the gated activations also write quantized (see [`X16`]): decoding
/// batches of up to 64 sequences of a 16384-wide FFN; long prompts go to cuBLAS and do not
/// read them.
const X16_FUSED_MAX: usize = 1 << 20;

/// A device buffer grown to the largest size asked for.
pub(super) struct Scratch<T> {
    buf: Mutex<Option<CudaSlice<T>>>,
    what: &'static str,
}

impl<T: DeviceRepr + ValidAsZeroBits> Scratch<T> {
    pub fn new(what: &'static str) -> Scratch<T> {
        Scratch {
            buf: Mutex::new(None),
            what,
        }
    }

    /// The device address of room for `len` values, after growing the buffer when it is
    /// smaller. Growing drops a recorded pass (it used the old buffer) and is not possible while
    /// recording: then an error that says the pass did not run.
    pub fn room(&self, queue: &Queue, graphs: &Graphs, len: usize) -> Result<u64, BackendError> {
        let mut slot = self.buf.lock().expect("not poisoned");
        match slot.as_ref() {
            Some(b) if b.len() >= len => Ok(queue.addr(b)),
            _ => {
                graphs.before_realloc(self.what)?;
                let b = queue.alloc_zeros::<T>(len, self.what)?;
                let addr = queue.addr(&b);
                *slot = Some(b);
                Ok(addr)
            }
        }
    }

    /// The first `out.len()` values of the buffer on the host, after the work queued before
    /// (`out` must fit in what [`Scratch::room`] last gave).
    pub fn read(&self, queue: &Queue, out: &mut [T], op: &'static str) -> Result<(), BackendError> {
        let slot = self.buf.lock().expect("not poisoned");
        match slot.as_ref() {
            Some(b) if b.len() >= out.len() => queue.read(b, out, op),
            _ => Err(BackendError::Unsupported {
                op,
                message: format!("reading {} values from a smaller scratch buffer", out.len()),
            }),
        }
    }

    /// [`Scratch::room`] for an optional use: None instead of growing while recording.
    pub fn room_if_free(
        &self,
        queue: &Queue,
        graphs: &Graphs,
        len: usize,
    ) -> Result<Option<u64>, BackendError> {
        let big_enough = self
            .buf
            .lock()
            .expect("not poisoned")
            .as_ref()
            .is_some_and(|b| b.len() >= len);
        if !big_enough && graphs.recording() {
            return Ok(None);
        }
        self.room(queue, graphs, len).map(Some)
    }
}

/// `n` f32 values at device address `x`, quantized at `xq`/`xs` by the op that wrote them;
/// valid while [`Queue::issued`] is still `at`.
#[derive(Clone, Copy, Debug)]
struct X16Memo {
    x: u64,
    n: usize,
    xq: u64,
    xs: u64,
    at: u64,
}

/// The activations of the quantized matmuls in the format of `quantize_x16_lanes`
/// (`common.cuh`): per 32-value block, 32 16-bit integers (64 bytes, at `xq`) and a
/// (scale, sum, integer sum) record (16 bytes, at `xs`).
///
/// rmsnorm and the gated activations write their output in this format too, and remember where; the quantized
/// matmul reading that output next uses it instead of converting x again. The memo holds only
/// while nothing else has been queued since ([`Queue::issued`] has not moved): every launch,
/// copy and allocation goes through the [`Queue`], which counts it, so no op can write the
/// activations (or reuse their memory) without the memo seeing it.
pub(super) struct X16 {
    scratch: Scratch<u8>,
    memo: Mutex<Option<X16Memo>>,
    /// Launches of `quantize_x16` (the inputs that no producer had quantized).
    launches: AtomicU64,
}

impl X16 {
    pub fn new() -> X16 {
        X16 {
            scratch: Scratch::new("allocating quantized activations"),
            memo: Mutex::new(None),
            launches: AtomicU64::new(0),
        }
    }

    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// Bytes of room for `n` activations (a multiple of 32), and the offset of the block
    /// records in it: the integers come first.
    fn layout(n: usize) -> (usize, u64) {
        let n_blocks = n / 32;
        (n_blocks * 80, (n_blocks * 64) as u64)
    }

    /// Where a producer of `n` activations writes their quantized form (when `n` is whole
    /// blocks and the scratch is there), or (0, 0): no fused write.
    pub fn fused_target(
        &self,
        queue: &Queue,
        graphs: &Graphs,
        n: usize,
    ) -> Result<(u64, u64), BackendError> {
        if n == 0 || !n.is_multiple_of(32) || n > X16_FUSED_MAX {
            return Ok((0, 0));
        }
        let (bytes, records) = X16::layout(n);
        let xq = self.scratch.room_if_free(queue, graphs, bytes)?;
        Ok(xq.map_or((0, 0), |xq| (xq, xq + records)))
    }

    /// After the launch that wrote `n` activations at `x` and, unless `xq` is 0, their
    /// quantized form.
    pub fn remember(&self, queue: &Queue, x: u64, n: usize, (xq, xs): (u64, u64)) {
        let at = queue.issued();
        *self.memo.lock().expect("not poisoned") =
            (xq != 0).then_some(X16Memo { x, n, xq, xs, at });
    }

    /// Where the op just before this one left `n` activations at `xp` quantized, if it did:
    /// the memo of an rmsnorm or a gated activation when nothing was queued since, and `xp` lies in its
    /// output at a whole block.
    pub fn lookup(&self, queue: &Queue, xp: u64, n: usize) -> Option<(u64, u64)> {
        let memo = (*self.memo.lock().expect("not poisoned"))?;
        let offset = xp.checked_sub(memo.x)? / 4;
        let fits = queue.issued() == memo.at
            && (xp - memo.x).is_multiple_of(128)
            && offset as usize + n <= memo.n;
        fits.then(|| {
            let block = offset / 32;
            (memo.xq + block * 64, memo.xs + block * 16)
        })
    }

    /// `n` activations at `xp` converted by a `quantize_x16` launch of their own.
    pub fn quantize(
        &self,
        queue: &Queue,
        graphs: &Graphs,
        kernels: &Kernels,
        xp: u64,
        n: usize,
    ) -> Result<(u64, u64), BackendError> {
        let (bytes, records) = X16::layout(n);
        let xq = self.scratch.room(queue, graphs, bytes)?;
        let xs = xq + records;
        let n64 = n as u64;
        let mut b = queue.kernel(&kernels.quantize_x16, "quantize_x16 kernel");
        b.arg(&xp).arg(&n64).arg(&xq).arg(&xs);
        // SAFETY: x holds n f32 values (n a multiple of 32; activation rows are 16-byte
        // aligned); the scratch holds n/32 64-byte blocks of integers at xq and n/32 16-byte
        // records at xs (16-byte aligned: n/32·64 is). One thread per 4 values.
        unsafe { b.run(elementwise(n / 4)) }?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok((xq, xs))
    }
}
