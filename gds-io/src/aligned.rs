//! Heap memory aligned for O_DIRECT.
//!
//! O_DIRECT requires the buffer address, the file offset and the length to be multiples of the
//! logical block size. 4096 covers every device we meet (512-byte and 4 KiB sectors) and is the
//! alignment of every tensor and blob in the GdsLLM format.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of [`AlignedBuf`] addresses and lengths, and of every O_DIRECT request.
pub const IO_ALIGN: usize = 4096;

/// Rounds `n` up to a multiple of [`IO_ALIGN`].
pub const fn align_up(n: u64) -> u64 {
    n.div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64
}

/// Rounds `n` down to a multiple of [`IO_ALIGN`].
pub const fn align_down(n: u64) -> u64 {
    n / IO_ALIGN as u64 * IO_ALIGN as u64
}

/// The allocator could not provide the memory (or the size overflows a `Layout`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("could not allocate {bytes} bytes of {IO_ALIGN}-byte-aligned host memory")]
pub struct AllocError {
    pub bytes: usize,
}

/// Zero-initialised heap memory whose address and length are multiples of [`IO_ALIGN`].
///
/// Allocation failure is an error value, not an abort, so callers that plan memory (the
/// residency cache) can shrink their plan instead of dying.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like Vec<u8>); shared access only hands
// out `&[u8]` and mutation needs `&mut self`, so moving it or sharing `&AlignedBuf` across
// threads is as safe as for Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; `&AlignedBuf` gives only immutable access to initialised bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` rounded up to a multiple of [`IO_ALIGN`].
    pub fn zeroed(len: usize) -> Result<AlignedBuf, AllocError> {
        let rounded = len
            .checked_next_multiple_of(IO_ALIGN)
            .ok_or(AllocError { bytes: len })?;
        if rounded == 0 {
            return Ok(AlignedBuf {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(rounded, IO_ALIGN)
            .map_err(|_| AllocError { bytes: rounded })?;
        // SAFETY: `layout` has a non-zero size (checked above) and a valid power-of-two
        // alignment, as `alloc_zeroed` requires.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(AllocError { bytes: rounded })?;
        Ok(AlignedBuf { ptr, len: rounded })
    }

    /// Length in bytes (always a multiple of [`IO_ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn layout(&self) -> Layout {
        // Cannot fail: the same size and alignment were accepted in `zeroed`.
        Layout::from_size_align(self.len, IO_ALIGN).expect("layout was valid at allocation")
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this layout and is
            // freed only here, once.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout()) }
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed, then only written through
        // `&mut [u8]`) bytes owned by `self`, or is dangling with `len == 0`, which is allowed
        // for an empty slice; the borrow is tied to `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_up_and_aligns() {
        for len in [0usize, 1, 4095, 4096, 4097, 3 * 4096 + 17] {
            let buf = AlignedBuf::zeroed(len).unwrap();
            assert_eq!(buf.len() % IO_ALIGN, 0);
            assert!(buf.len() >= len && buf.len() < len + IO_ALIGN);
            if len > 0 {
                assert_eq!(buf.as_ptr() as usize % IO_ALIGN, 0);
            }
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn writes_are_visible() {
        let mut buf = AlignedBuf::zeroed(8192).unwrap();
        buf[8191] = 7;
        buf[0] = 3;
        assert_eq!((buf[0], buf[8191]), (3, 7));
    }

    #[test]
    fn impossible_size_is_an_error() {
        assert!(AlignedBuf::zeroed(usize::MAX - 10).is_err());
        assert!(AlignedBuf::zeroed(isize::MAX as usize).is_err());
    }

    #[test]
    fn align_helpers() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), 4096);
        assert_eq!(align_down(8191), 4096);
    }
}
