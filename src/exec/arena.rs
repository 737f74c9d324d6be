//! The activation arena: one 64-byte-aligned allocation, carved into
//! buffers by the plan.

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// One aligned block of f32s. Slices are handed out by offset; the plan
/// guarantees that slices used together do not overlap.
pub struct Arena {
    lines: Vec<Line>,
}

impl Arena {
    pub fn new(bytes: usize) -> Self {
        Arena {
            lines: vec![Line([0.0; 16]); bytes.div_ceil(64)],
        }
    }

    pub fn len(&self) -> usize {
        self.lines.len() * 16
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    pub fn base(&mut self) -> ArenaPtr {
        ArenaPtr {
            ptr: self.lines.as_mut_ptr().cast::<f32>(),
            len: self.len(),
        }
    }
}

/// A raw view of the arena used while a step runs.
#[derive(Clone, Copy)]
pub struct ArenaPtr {
    ptr: *mut f32,
    len: usize,
}

impl ArenaPtr {
    /// # Safety
    /// `off..off+len` must lie in the arena and must not be written through
    /// another slice while the returned one lives.
    pub unsafe fn slice<'a>(self, off: usize, len: usize) -> &'a [f32] {
        assert!(off + len <= self.len, "arena slice out of bounds");
        std::slice::from_raw_parts(self.ptr.add(off), len)
    }

    /// # Safety
    /// `off..off+len` must lie in the arena and no other live slice may
    /// overlap it.
    pub unsafe fn slice_mut<'a>(self, off: usize, len: usize) -> &'a mut [f32] {
        assert!(off + len <= self.len, "arena slice out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(off), len)
    }
}
