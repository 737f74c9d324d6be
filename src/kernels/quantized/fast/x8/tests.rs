use super::*;
use crate::kernels::testutil::{random_blocks, Rng, FAST_FORMATS};

#[test]
fn layouts_cover_every_block_byte_once() {
    for dtype in FAST_FORMATS {
        let ps = parts(dtype).unwrap();
        let mut seen = vec![0; dtype.block_bytes()];
        for p in ps {
            let (at, l) = match *p {
                Part::Rows(a, l) | Part::Cols(a, l) | Part::Words(a, l) => (a, l),
            };
            if let Part::Words(..) = p {
                assert!(l.is_multiple_of(4), "{dtype}");
            }
            seen[at..at + l].iter_mut().for_each(|s| *s += 1);
        }
        assert!(seen.iter().all(|&s| s == 1), "{dtype}: {seen:?}");
        // A round trip through the layout.
        let mut rng = Rng::new(9);
        let (n, nblk) = (16, 3);
        let rb = nblk * dtype.block_bytes();
        let src = random_blocks(dtype, n * nblk, &mut rng);
        let mut x8 = vec![0u8; src.len()];
        repack(dtype, &src, rb, &mut x8);
        assert_ne!(x8, src, "{dtype}");
        let mut back = vec![0u8; 5 * rb];
        unpack_rows(dtype, &x8, rb, 6, 11, &mut back);
        assert_eq!(back, src[6 * rb..11 * rb], "{dtype}");
        // Whole groups (the vector transpose) and a partial group before them.
        for (r0, r1) in [(0, 16), (3, 16), (8, 16)] {
            let mut back = vec![0u8; (r1 - r0) * rb];
            unpack_rows(dtype, &x8, rb, r0, r1, &mut back);
            assert_eq!(back, src[r0 * rb..r1 * rb], "{dtype} rows {r0}..{r1}");
        }
    }
}
