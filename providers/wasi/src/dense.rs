//! Linear memories and async stacks laid out for tens of thousands of small
//! instances on one node.
//!
//! wasmtime's defaults suit a few large instances: each linear memory
//! reserves 4 GiB of address space plus guard regions (bounds checks are
//! elided), and each async stack is its own mapping with a guard page.
//! Every pod then costs about 6 memory mappings and 4 GiB of address
//! space, so a node runs out of `vm.max_map_count` (65,530 by default)
//! near 11,000 pods and of the 128 TiB address space near 32,000, and the
//! process aborts on its next allocation. Here instead:
//!
//! - **Linear memories** ([`DenseMemories`]) are one private anonymous
//!   mapping each, read-write and reserved without swap accounting, sized
//!   to the memory's current size. Compiled code checks bounds against the
//!   current size (the engine's reservation is 0), so nothing past it is
//!   ever touched. Growth past the mapping doubles it with `mremap`, which
//!   moves page tables instead of copying bytes. Address space per memory
//!   is at most twice its size (capped at its maximum); pages cost memory
//!   only once written.
//! - **Async stacks** ([`SlabStacks`]) are cut from slabs of
//!   [`STACKS_PER_SLAB`]: one mapping per slab, with one guard page under
//!   it, instead of two mappings per stack. A stack given back is emptied
//!   with `madvise(MADV_DONTNEED)` (its memory returns to the system, and
//!   it reads as zeroes next time) and reused. Wasm code cannot overflow
//!   its stack: compiled code checks its depth against `max_wasm_stack`,
//!   and the stack is larger by the room host calls need (see
//!   the runtime module). What a guard page per stack would add is a clean
//!   crash instead of a corrupt neighbour if the host's own code (WASI)
//!   went deeper than that room; the slab's one guard catches it for the
//!   lowest stack only.

// Mapping memory for wasmtime needs unsafe calls; each says why it is sound.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex, RwLock};

use rustix::mm::{Advice, MapFlags, MremapFlags, ProtFlags};
use wasmtime::{LinearMemory, MemoryCreator, MemoryType, StackCreator, StackMemory};

/// Gives the heap's free memory back to the system. glibc keeps what was
/// freed for reuse; after 50,000 pods left, that was 2.4 GiB of RSS.
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heap under its locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Stacks per slab (one mapping).
pub(crate) const STACKS_PER_SLAB: usize = 64;

/// The host's page size (4 KiB on x86-64; 16 or 64 KiB on some arm64 and
/// ppc64 kernels): mappings, stacks and guards are multiples of it.
fn page() -> usize {
    rustix::param::page_size()
}

/// A fresh private read-write mapping of `bytes`, reserved without swap
/// accounting (pages cost memory once written).
fn map_fresh(bytes: usize) -> std::io::Result<*mut c_void> {
    // SAFETY: a new anonymous mapping at an address the kernel picks:
    // nothing else refers to it.
    unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            bytes,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .map_err(std::io::Error::from)
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|n| n / to * to)
}

/// Creates linear memories as single growable mappings.
#[derive(Default)]
pub(crate) struct DenseMemories;

// SAFETY: every memory is a private, zero-filled, page-aligned mapping of
// at least its byte size, owned by the `Linear` it is returned in. Memories
// with a reservation or a guard region are refused: only with neither does
// compiled code check every access against `byte_size` (wasmtime elides
// checks only when reservation + guard cover 4 GiB, and uses a reservation
// as a fixed bound). The engine must also have `memory_init_cow(false)`:
// copy-on-write images need wasmtime's own mappings.
unsafe impl MemoryCreator for DenseMemories {
    fn new_memory(
        &self,
        _ty: MemoryType,
        minimum: usize,
        maximum: Option<usize>,
        reserved_size_in_bytes: Option<usize>,
        guard_size_in_bytes: usize,
    ) -> Result<Box<dyn LinearMemory>, String> {
        if guard_size_in_bytes != 0 {
            return Err(format!("dense memories have no guard region, asked for {guard_size_in_bytes} bytes"));
        }
        if let Some(reserved) = reserved_size_in_bytes.filter(|r| *r != 0) {
            return Err(format!("dense memories have no reservation, asked for {reserved} bytes"));
        }
        let capacity = round_up(minimum.max(page()), page()).ok_or("memory size out of range")?;
        let ptr = map_fresh(capacity).map_err(|e| format!("cannot map {capacity} bytes of linear memory: {e}"))?;
        Ok(Box::new(Linear { ptr: ptr as usize, size: minimum, capacity, maximum }))
    }
}

/// One linear memory: `capacity` bytes mapped at `ptr`, `size` of them in
/// use.
struct Linear {
    ptr: usize,
    size: usize,
    capacity: usize,
    maximum: Option<usize>,
}

// SAFETY: `ptr..ptr + capacity` is mapped read-write for as long as this
// value lives, and `size <= capacity`.
unsafe impl LinearMemory for Linear {
    fn byte_size(&self) -> usize {
        self.size
    }

    fn byte_capacity(&self) -> usize {
        self.capacity
    }

    fn grow_to(&mut self, new_size: usize) -> wasmtime::Result<()> {
        if let Some(maximum) = self.maximum
            && new_size > maximum
        {
            wasmtime::bail!("memory of {new_size} bytes is over its maximum of {maximum}");
        }
        if new_size > self.capacity {
            let doubled = self.capacity.saturating_mul(2);
            let wanted = new_size.max(match self.maximum {
                Some(maximum) => doubled.min(maximum),
                None => doubled,
            });
            let capacity = round_up(wanted, page()).ok_or_else(|| wasmtime::format_err!("memory size out of range"))?;
            // SAFETY: the old range is ours and mapped; MAYMOVE gives a new
            // address that this value owns from now on.
            let ptr =
                unsafe { rustix::mm::mremap(self.ptr as *mut c_void, self.capacity, capacity, MremapFlags::MAYMOVE) }
                    .map_err(|e| wasmtime::format_err!("cannot grow linear memory to {capacity} bytes: {e}"))?;
            self.ptr = ptr as usize;
            self.capacity = capacity;
        }
        self.size = new_size;
        Ok(())
    }

    fn as_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

impl Drop for Linear {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and nothing refers to it any more.
        let _ = unsafe { rustix::mm::munmap(self.ptr as *mut c_void, self.capacity) };
    }
}

/// Async stacks cut from shared slabs.
#[derive(Default)]
pub(crate) struct SlabStacks {
    pools: Mutex<HashMap<usize, Arc<Pool>>>,
}

impl SlabStacks {
    /// Mappings made so far (slabs), and stacks handed out now.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.values().fold((0, 0), |(slabs, used), pool| {
            let inner = pool.inner.lock().unwrap_or_else(|p| p.into_inner());
            (slabs + inner.slabs, used + inner.slabs * STACKS_PER_SLAB - inner.free.len())
        })
    }
}

/// The stacks of one size.
struct Pool {
    size: usize,
    inner: Mutex<PoolInner>,
}

#[derive(Default)]
struct PoolInner {
    /// Bottoms of free stacks.
    free: Vec<usize>,
    /// Bottoms of the stacks handed out.
    live: std::collections::HashSet<usize>,
    slabs: usize,
}

impl Pool {
    fn take(self: &Arc<Pool>) -> Result<SlabStack, wasmtime::Error> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.free.is_empty() {
            let slot = self.slot();
            let bytes = slot
                .checked_mul(STACKS_PER_SLAB)
                .and_then(|b| b.checked_add(page()))
                .ok_or_else(|| wasmtime::format_err!("stack size out of range"))?;
            // Its first page becomes the guard.
            let base = map_fresh(bytes)
                .map_err(|e| wasmtime::format_err!("cannot map a slab of {bytes} bytes of stacks: {e}"))?;
            // SAFETY: the first page of the mapping just made.
            unsafe { rustix::mm::mprotect(base, page(), rustix::mm::MprotectFlags::empty()) }
                .map_err(|e| wasmtime::format_err!("cannot protect a stack slab's guard page: {e}"))?;
            let first = base as usize + page();
            inner.free.extend((0..STACKS_PER_SLAB).rev().map(|i| first + i * slot));
            inner.slabs += 1;
        }
        let bottom = inner.free.pop().expect("a slab was just added");
        inner.live.insert(bottom);
        let stack = SlabStack { bottom, pool: self.clone() };
        let range = stack.range();
        write_lock(&LIVE_STACKS).insert(range.start, range.end);
        Ok(stack)
    }

    /// A stack and its guard zone.
    fn slot(&self) -> usize {
        self.size + page()
    }
}

/// The stacks handed out now: start → end of each (its guard zone is the
/// page below its start).
static LIVE_STACKS: RwLock<BTreeMap<usize, usize>> = RwLock::new(BTreeMap::new());

fn write_lock<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether the guard zone at `zone` (one page, mapped read-write by its
/// slab) is intact: all zeroes.
fn zone_intact(zone: usize) -> bool {
    // SAFETY: `zone..zone + page()` lies inside a slab mapping that is
    // never unmapped (slabs live as long as the process), is readable,
    // and is written by nothing but an overflowing stack above it: reading
    // it races with no write of ours.
    let bytes = unsafe { std::slice::from_raw_parts(zone as *const u8, page()) };
    bytes.iter().all(|b| *b == 0)
}

/// The guard zone below an instance's stack was overwritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the guard zone below this instance's stack ({size} bytes at {zone:#x}) was overwritten: host code overflowed \
     the stack; the instance is ended before it can run on a damaged stack"
)]
pub(crate) struct StackOverflowed {
    /// Where the zone starts.
    pub zone: usize,
    /// Its size in bytes.
    pub size: usize,
}

/// Checks the guard zone of the stack this code runs on, if it is one of
/// these slabs' (else there is nothing to check: the stack is wasmtime's
/// own, with a guard page). An error says the zone was overwritten: host
/// code overflowed the stack, and the instance running on it must end.
pub(crate) fn check_current_stack() -> Result<(), StackOverflowed> {
    let marker = 0u8;
    let here = std::hint::black_box(&marker) as *const u8 as usize;
    let live = LIVE_STACKS.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some((&start, &end)) = live.range(..=here).next_back() else { return Ok(()) };
    if here >= end {
        return Ok(());
    }
    if zone_intact(start - page()) { Ok(()) } else { Err(StackOverflowed { zone: start - page(), size: page() }) }
}

/// One stack of a slab.
struct SlabStack {
    bottom: usize,
    pool: Arc<Pool>,
}

// SAFETY: `StackMemory` requires that `top()` is the (16-byte aligned)
// end of a region `range()` that is mapped read-write, usable as a stack
// by one fiber, and not used by anything else while this value lives, and
// that `guard_range()` is inside it or empty. Here: `bottom` is the slot's
// guard zone (one page), `range()` is the `size` bytes above it, page
// aligned (so `top()` is too), mapped read-write by the slab, zero when
// handed out (fresh, or emptied by MADV_DONTNEED), and handed to one
// `SlabStack` at a time (the pool's free list holds each slot once). The
// guard range is empty: the zone is not a protected page, it is checked
// (`check_current_stack`, and on drop).
unsafe impl StackMemory for SlabStack {
    fn top(&self) -> *mut u8 {
        (self.bottom + self.pool.slot()) as *mut u8
    }

    fn range(&self) -> Range<usize> {
        self.bottom + page()..self.bottom + self.pool.slot()
    }

    fn guard_range(&self) -> Range<*mut u8> {
        self.bottom as *mut u8..self.bottom as *mut u8
    }
}

impl Drop for SlabStack {
    fn drop(&mut self) {
        write_lock(&LIVE_STACKS).remove(&(self.bottom + page()));
        self.pool.inner.lock().unwrap_or_else(|p| p.into_inner()).live.remove(&self.bottom);
        if !zone_intact(self.bottom) {
            // The stack below may hold a suspended fiber's frames: its
            // instance is checked when it next returns from a host call.
            tracing::error!(
                zone = format_args!("{:#x}", self.bottom),
                "an async stack's guard zone was overwritten (host code overflowed it); the stack is not reused"
            );
            return;
        }
        // SAFETY: the stack is no longer in use; its pages (zone included,
        // which is zero already) go back to the system and read as zeroes
        // when next touched.
        let emptied =
            unsafe { rustix::mm::madvise(self.bottom as *mut c_void, self.pool.slot(), Advice::LinuxDontNeed) };
        if emptied.is_ok() {
            self.pool.inner.lock().unwrap_or_else(|p| p.into_inner()).free.push(self.bottom);
        }
        // A stack that could not be emptied is not reused (it stays mapped
        // with its slab).
    }
}

impl SlabStacks {
    /// Overwrites the guard zone of every stack of these slabs handed out
    /// now (as an overflow would): for tests of the check. Returns how
    /// many.
    #[cfg(test)]
    pub(crate) fn damage_live_zones(&self) -> usize {
        let pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let mut damaged = 0;
        for pool in pools.values() {
            for bottom in &pool.inner.lock().unwrap_or_else(|p| p.into_inner()).live {
                // SAFETY: the highest byte of a live stack's guard zone:
                // mapped read-write by its slab, and read by nothing but
                // the checks.
                unsafe { ((bottom + page() - 1) as *mut u8).write_volatile(0xAA) };
                damaged += 1;
            }
        }
        damaged
    }
}

// SAFETY: each stack is page-aligned, zero-filled when handed out, and
// owned by one fiber at a time.
unsafe impl StackCreator for SlabStacks {
    fn new_stack(&self, size: usize, _zeroed: bool) -> Result<Box<dyn StackMemory>, wasmtime::Error> {
        let size =
            round_up(size.max(page()), page()).ok_or_else(|| wasmtime::format_err!("stack size out of range"))?;
        let pool = self
            .pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(size)
            .or_insert_with(|| Arc::new(Pool { size, inner: Mutex::default() }))
            .clone();
        Ok(Box::new(pool.take()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_grows_in_place_and_then_moves_keeping_its_bytes() {
        const WASM_PAGE: usize = 65536;
        let mut memory =
            DenseMemories.new_memory(MemoryType::new(2, None), 2 * WASM_PAGE, None, Some(0), 0).expect("memory");
        assert_eq!(memory.byte_size(), 2 * WASM_PAGE);
        // SAFETY: within byte_size.
        unsafe { memory.as_ptr().add(100).write(42) };
        // Past the mapping: it doubles (4 pages).
        memory.grow_to(3 * WASM_PAGE).expect("grow");
        assert_eq!((memory.byte_size(), memory.byte_capacity()), (3 * WASM_PAGE, 4 * WASM_PAGE));
        // Within the mapping: nothing moves.
        let base = memory.as_ptr();
        memory.grow_to(4 * WASM_PAGE).expect("grow");
        assert_eq!(memory.as_ptr(), base, "growth within the mapping keeps the base");
        // One grow past double takes exactly what it asks.
        memory.grow_to(20 * WASM_PAGE).expect("grow");
        assert_eq!(memory.byte_capacity(), 20 * WASM_PAGE);
        // SAFETY: within byte_size.
        unsafe {
            assert_eq!(memory.as_ptr().add(100).read(), 42);
            assert_eq!(memory.as_ptr().add(20 * WASM_PAGE - 1).read(), 0);
        }
    }

    #[test]
    fn a_memory_refuses_to_grow_past_its_maximum_or_with_a_guard() {
        let mut memory =
            DenseMemories.new_memory(MemoryType::new(1, Some(2)), 65536, Some(131072), Some(0), 0).expect("memory");
        let error = memory.grow_to(196608).expect_err("over the maximum");
        assert!(error.to_string().contains("over its maximum"), "{error}");
        assert_eq!(memory.byte_size(), 65536);
        let refused = DenseMemories.new_memory(MemoryType::new(1, None), 65536, None, Some(0), 4096);
        assert!(refused.err().is_some_and(|e| e.contains("no guard region")));
        let refused = DenseMemories.new_memory(MemoryType::new(1, None), 65536, None, Some(1 << 32), 0);
        assert!(refused.err().is_some_and(|e| e.contains("no reservation")));
    }

    #[test]
    fn stacks_share_slabs_and_come_back_empty() {
        let stacks = SlabStacks::default();
        let first: Vec<_> = (0..STACKS_PER_SLAB + 1).map(|_| stacks.new_stack(65536, false).expect("stack")).collect();
        assert_eq!(stacks.counts(), (2, STACKS_PER_SLAB + 1));
        for stack in &first {
            // SAFETY: the highest byte of a stack we own.
            unsafe { stack.top().sub(1).write(7) };
        }
        let bottoms: std::collections::HashSet<usize> = first.iter().map(|s| s.range().start).collect();
        assert_eq!(bottoms.len(), STACKS_PER_SLAB + 1, "no two stacks overlap at their bottoms");
        drop(first);
        assert_eq!(stacks.counts(), (2, 0));
        let again = stacks.new_stack(65536, true).expect("stack");
        // SAFETY: a byte of a stack we own.
        assert_eq!(unsafe { again.top().sub(1).read() }, 0, "a reused stack reads as zeroes");
        assert_eq!(stacks.counts(), (2, 1));
    }
}
