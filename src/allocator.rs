//! The binaries' global allocator: mimalloc, called the way Rust's own `System` allocator calls
//! the C library's.
//!
//! mimalloc rather than glibc's malloc, which took a third of the server's CPU under load
//! (`bench/RESULTS.md`). Not the `mimalloc` crate's `MiMalloc`, though: it sends every
//! allocation through `mi_malloc_aligned`, whose fast path only takes a block that happens to
//! be aligned already and whose slow path over-allocates, for the alignment of 1 to 16 that
//! nearly every Rust allocation asks for and that plain `mi_malloc` always gives. Routing
//! those to `mi_malloc` saved 3 % of a turn's instructions (`bench/RESULTS.md`).
//!
//! This is the crate's only `unsafe` code (the lint denies it everywhere else): implementing
//! `GlobalAlloc` cannot be done without it. The rule is `System`'s on Unix: a layout whose
//! alignment is at most [`MIN_ALIGN`] and at most its size gets the plain call, anything else
//! the aligned one. It holds because mimalloc rounds every block of more than 8 bytes to a
//! multiple of 16 (`MI_ALIGN2W` where `MI_MAX_ALIGN_SIZE` is 16, on 64-bit targets) and starts
//! its pages aligned, so a block of `size` bytes is aligned to 16 or to `size`, whichever is
//! less. The tests below check that for every size up to 4 KiB and every alignment up to 4 KiB.
//!
//! What the rule depends on, exactly: mimalloc built with `MI_MAX_ALIGN_SIZE` 16 (its default on
//! 64-bit targets; `libmimalloc-sys` sets no other, and none of our features touches it), and its
//! size classes rounding small blocks up in steps of that. A build that changed either (a
//! `MI_MAX_ALIGN_SIZE` of 8, say) would fail those tests, not serve misaligned blocks unseen. What
//! would retire this file: the `mimalloc` crate's `MiMalloc` choosing `mi_malloc` for these
//! layouts itself, as `System` chooses `malloc`; then it is a one-line `#[global_allocator]`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment `mi_malloc` gives every block of at least this size: `MI_MAX_ALIGN_SIZE`.
pub const MIN_ALIGN: usize = 16;

/// mimalloc as the global allocator: `#[global_allocator] static A: Mimalloc = Mimalloc;`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mimalloc;

/// Whether the plain calls give `layout`'s alignment.
fn plain(align: usize, size: usize) -> bool {
    align <= MIN_ALIGN && align <= size
}

// SAFETY: every method hands the layout's size (and, where the plain call would not give it,
// its alignment) to the mimalloc function made for that request, and frees only pointers that
// mimalloc returned, as `GlobalAlloc`'s contract asks of callers; `mi_free` and the `realloc`
// functions take a pointer from any of mimalloc's allocation functions.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: `layout`'s size is non-zero (the caller's obligation); `mi_malloc_aligned`
        // takes any power-of-two alignment, which `Layout` guarantees.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe {
            if plain(layout.align(), layout.size()) {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator, so from mimalloc (the caller's obligation).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout` and `new_size` is non-zero (the
        // caller's obligations); the block keeps `layout`'s alignment at its new size.
        unsafe {
            if plain(layout.align(), new_size) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Allocates, checks the alignment, writes every byte, grows, checks again, and frees.
    fn round_trip(size: usize, align: usize, zeroed: bool) {
        let layout = Layout::from_size_align(size, align).unwrap();
        let a = Mimalloc;
        // SAFETY: a non-zero size; every pointer is freed with its layout once.
        unsafe {
            let p = if zeroed {
                a.alloc_zeroed(layout)
            } else {
                a.alloc(layout)
            };
            assert!(!p.is_null(), "size {size}, align {align}");
            assert_eq!(p as usize % align, 0, "size {size}, align {align}");
            if zeroed {
                assert!(
                    (0..size).all(|i| *p.add(i) == 0),
                    "size {size}, align {align}"
                );
            }
            p.write_bytes(0xa5, size);
            let grown = size * 2 + 8;
            let q = a.realloc(p, layout, grown);
            assert!(!q.is_null());
            assert_eq!(
                q as usize % align,
                0,
                "realloc of size {size}, align {align}"
            );
            assert!(
                (0..size).all(|i| *q.add(i) == 0xa5),
                "realloc kept the bytes"
            );
            a.dealloc(q, Layout::from_size_align(grown, align).unwrap());
        }
    }

    #[test]
    fn every_size_and_alignment_is_aligned() {
        for size in (1..=512).chain((520..=4096).step_by(8)) {
            for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
                round_trip(size, align, false);
            }
        }
        for size in [1, 7, 8, 9, 15, 16, 17, 24, 40, 1000, 5000] {
            for align in [1, 8, 16, 64] {
                round_trip(size, align, true);
            }
        }
    }
}
