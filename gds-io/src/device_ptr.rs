//! A borrowed range of device memory: the device-side counterpart of `&'a [u8]`.

use std::marker::PhantomData;

/// `len` bytes of device memory at `addr`, allocated for at least the lifetime `'a` of whatever
/// owns them (as cudarc's `CudaView` borrows a `CudaSlice`). Kernels take the address; the
/// lifetime keeps the owner — a device buffer, a residency guard — from freeing the memory while
/// it is used. Ordering writes against the kernels that read is the owner's part (residency
/// refills a buffer only under its write lock, after the readers' release fences).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DevicePtr<'a> {
    addr: u64,
    len: usize,
    _borrow: PhantomData<&'a [u8]>,
}

impl std::fmt::Debug for DevicePtr<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevicePtr({:#x}, {} bytes)", self.addr, self.len)
    }
}

impl<'a> DevicePtr<'a> {
    /// A range of device memory known only by its address.
    ///
    /// # Safety
    ///
    /// `addr .. addr + len` must be device memory of the current CUDA context that stays
    /// allocated for `'a`.
    pub unsafe fn from_raw(addr: u64, len: usize) -> DevicePtr<'a> {
        DevicePtr {
            addr,
            len,
            _borrow: PhantomData,
        }
    }

    /// The device address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes from `offset`, or `None` when they do not lie inside this range.
    pub fn slice(&self, offset: usize, len: usize) -> Option<DevicePtr<'a>> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(DevicePtr {
            addr: self.addr + offset as u64,
            len,
            _borrow: PhantomData,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_stay_inside_the_range() {
        // SAFETY: never dereferenced; only the arithmetic is tested.
        let p = unsafe { DevicePtr::from_raw(0x1000, 100) };
        let s = p.slice(10, 20).unwrap();
        assert_eq!((s.addr(), s.len()), (0x100a, 20));
        assert_eq!(p.slice(90, 10).map(|s| s.addr()), Some(0x105a));
        assert!(p.slice(90, 11).is_none());
        assert!(p.slice(usize::MAX, 2).is_none());
    }
}
