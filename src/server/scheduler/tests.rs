use super::*;

fn sched(parallel: usize, step_tokens: usize, blocks: usize) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            parallel,
            step_tokens,
            context: blocks * 4,
        },
        KvPool::new(blocks, 4),
    )
}

/// Runs one step: plans it, checks the batch against the plan, records
/// it, and gives every sampling sequence the token `100 + id`.
fn step(s: &mut Scheduler, batch: &mut Batch) -> Vec<Slot> {
    let plan = s.schedule(batch).to_vec();
    assert_eq!(batch.n_seqs(), plan.len());
    assert_eq!(
        batch.n_tokens(),
        plan.iter().map(|p| p.tokens).sum::<usize>()
    );
    assert!(batch.n_tokens() <= s.config().step_tokens);
    assert!(plan.len() <= s.config().parallel);
    s.advance();
    for p in &plan {
        if p.samples {
            s.push_token(p.id, 100 + p.id as u32);
        }
    }
    plan
}

#[test]
fn prompts_are_chunked_beside_decode_tokens() {
    let mut s = sched(4, 8, 16);
    let mut b = Batch::default();
    assert!(s.admit(1, &[1; 10], 5));
    let p = step(&mut s, &mut b);
    assert_eq!(
        p,
        [Slot {
            id: 1,
            tokens: 8,
            samples: false
        }]
    );
    assert!(s.admit(2, &[2; 6], 5));
    // Sequence 1's last 2 prompt tokens, then 6 of sequence 2's.
    let p = step(&mut s, &mut b);
    assert_eq!(
        p,
        [
            Slot {
                id: 1,
                tokens: 2,
                samples: true
            },
            Slot {
                id: 2,
                tokens: 6,
                samples: true
            }
        ]
    );
    // Both decode now: one token each, decode first.
    assert!(s.admit(3, &[3; 20], 5));
    let p = step(&mut s, &mut b);
    assert_eq!(
        p[..2],
        [
            Slot {
                id: 1,
                tokens: 1,
                samples: true
            },
            Slot {
                id: 2,
                tokens: 1,
                samples: true
            }
        ]
    );
    assert_eq!(
        p[2],
        Slot {
            id: 3,
            tokens: 6,
            samples: false
        }
    );
    // The batch's sequence table: tokens contiguous, start positions.
    assert_eq!(
        b.seq_table()[..15],
        [0, 1, 10, 0, 1, 1, 1, 6, 3, 1, 2, 6, 0, 5, 1]
    );
}

#[test]
fn parallel_and_kv_bound_admission() {
    let mut s = sched(2, 64, 10);
    assert!(s.admit(1, &[0; 4], 4));
    assert!(s.admit(2, &[0; 4], 4));
    assert!(!s.can_admit(4), "two in flight");
    assert!(!s.admit(3, &[0; 4], 4));
    assert!(s.remove(1));
    assert!(s.can_admit(4));
    // 9 free blocks: 7 for a 28-token prompt plus one per running
    // sequence (one) fits, 8 blocks' worth of prompt does not.
    assert!(s.can_admit(28) && !s.can_admit(33));
    assert_eq!(
        s.check(30, 11),
        Err(AddError::TooLong {
            tokens: 41,
            context: 40
        })
    );
    assert_eq!(s.check(0, 1), Err(AddError::Empty));
    assert!(s.check(30, 10).is_ok());
}

#[test]
fn finished_and_cancelled_sequences_free_their_blocks_at_once() {
    let mut s = sched(4, 64, 8);
    let mut b = Batch::default();
    assert!(s.admit(1, &[0; 9], 3));
    assert!(s.admit(2, &[0; 5], 3));
    step(&mut s, &mut b);
    assert_eq!(s.kv_used(), (3 + 2) * 4);
    assert!(s.remove(1));
    assert_eq!(s.kv_used(), 2 * 4);
    assert!(!s.remove(1), "already gone");
    assert!(s.remove(2));
    assert_eq!(s.kv_used(), 0);
    assert!(s.is_idle());
    assert!(s.schedule(&mut b).is_empty() && b.is_empty());
}

#[test]
fn a_finished_prefix_is_reused_and_evicted_when_the_pool_needs_it() {
    let mut s = sched(4, 64, 8);
    let mut b = Batch::default();
    assert!(s.admit(1, &[1, 2, 3, 4, 5, 6], 3));
    step(&mut s, &mut b); // the prompt; samples 101
    step(&mut s, &mut b); // feeds 101; samples 101 again
    assert!(s.finish(1));
    // Fed: the 6 prompt tokens and 101, in 2 blocks, now cached.
    assert_eq!((s.kv_used(), s.kv_cached()), (0, 8));
    // A prompt sharing 5 tokens reuses them and is fed from the 6th.
    assert!(s.admit(2, &[1, 2, 3, 4, 5, 9, 9], 3));
    assert_eq!(s.reused_tokens(), 5);
    assert_eq!(s.kv_cached(), 0);
    let p = step(&mut s, &mut b);
    assert_eq!(p[0].tokens, 2);
    assert_eq!(&b.seq_table()[..3], &[0, 2, 5]);
    assert_eq!(b.tokens(), &[9, 9]);
    assert!(s.finish(2));
    // The same prompt again: only its last token is fed.
    assert!(s.admit(3, &[1, 2, 3, 4, 5, 9, 9], 3));
    assert_eq!(s.reused_tokens(), 5 + 6);
    let p = step(&mut s, &mut b);
    assert_eq!((p[0].tokens, p[0].samples), (1, true));
    assert_eq!(&b.seq_table()[..3], &[0, 1, 6]);
    assert!(s.remove(3), "removed, not cached");
    assert_eq!((s.kv_used(), s.kv_cached()), (0, 0));
    // Cached blocks are taken back for a prompt that needs the pool:
    // two cached sequences of 2 blocks each, then a 28-token prompt
    // (7 of the 8 blocks) with nothing in common.
    for id in [4, 5] {
        assert!(s.admit(id, &[id as u32; 5], 2));
    }
    step(&mut s, &mut b);
    assert!(s.finish(4) && s.finish(5));
    assert_eq!(s.kv_cached(), 16);
    assert!(s.can_admit(28));
    assert!(s.admit(6, &[7; 28], 4));
    assert_eq!(s.kv_used(), 28);
    assert!(s.kv_cached() <= 4);
    assert!(s.remove(6));
    s.clear_cache();
    assert_eq!((s.kv_used(), s.kv_cached()), (0, 0));
}

#[test]
fn prompts_arriving_together_share_their_common_blocks() {
    // Blocks of 4: sequences 2 and 3 share 10 and 9 tokens with
    // sequence 1, so 2 whole blocks each and part of the third;
    // sequence 4 shares nothing.
    let mut s = sched(4, 64, 16);
    let mut b = Batch::default();
    let p1: Vec<u32> = (1..=12).collect();
    let mut p2 = p1[..10].to_vec();
    p2.extend([50, 51, 52]);
    let mut p3 = p1[..9].to_vec();
    p3.push(60);
    for (id, p) in [(1, &p1), (2, &p2), (3, &p3), (4, &vec![9; 5])] {
        assert!(s.admit(id, p, 4));
    }
    // Step 1: sequence 1's prompt; 2 and 3 wait for its first blocks,
    // 4 is fed as usual.
    let plan = step(&mut s, &mut b);
    let fed: Vec<(SeqId, usize)> = plan.iter().map(|p| (p.id, p.tokens)).collect();
    assert_eq!(fed, [(1, 12), (4, 5)]);
    assert!(b.copy_table().is_empty());
    // Step 2: 2 and 3 read sequence 1's first two blocks, get its third
    // copied into their own, and are fed from positions 10 and 9.
    let plan = step(&mut s, &mut b);
    let fed: Vec<(SeqId, usize)> = plan.iter().map(|p| (p.id, p.tokens)).collect();
    assert_eq!(fed, [(1, 1), (4, 1), (2, 3), (3, 1)]);
    assert_eq!(s.reused_tokens(), 10 + 9);
    let rows: Vec<&[i32]> = b.seq_table().chunks(5).collect();
    let blocks = |row: &[i32], n: usize| {
        let off = row[3] as usize;
        b.block_table()[off..off + n].to_vec()
    };
    assert_eq!(
        (rows[2][2], rows[3][2]),
        (10, 9),
        "fed past the shared tokens"
    );
    let one = blocks(rows[0], 3);
    assert_eq!(blocks(rows[2], 2), one[..2]);
    assert_eq!(blocks(rows[3], 2), one[..2]);
    // Their own blocks past the shared ones are distinct; the third
    // starts as a copy of sequence 1's.
    let (b2, b3) = (blocks(rows[2], 4)[2..].to_vec(), blocks(rows[3], 3)[2]);
    assert!(!one.contains(&b3) && !b2.contains(&b3) && !b2.iter().any(|x| one.contains(x)));
    assert_eq!(b.copy_table(), [one[2], b2[0], one[2], b3]);
    // 1: 4 blocks, 2: 2 own (13 + 1 tokens), 3: 1 own, 4: 2; shared
    // blocks counted once.
    assert_eq!(s.kv_used(), (4 + 2 + 1 + 2) * 4);
    // Sequence 1 leaves: the shared blocks stay with 2 and 3.
    assert!(s.remove(1));
    assert_eq!(s.kv_used(), (2 + 2 + 1 + 2) * 4);
    step(&mut s, &mut b);
    for id in [2, 3, 4] {
        assert!(s.remove(id));
    }
    assert_eq!((s.kv_used(), s.kv_cached()), (0, 0));
    assert!(s.can_admit(16 * 4 - 4), "every block is free again");
}

#[test]
fn a_cached_prefix_inside_a_shared_block_is_completed_by_a_copy() {
    let mut s = sched(4, 64, 16);
    let mut b = Batch::default();
    let p1: Vec<u32> = (1..=9).collect();
    assert!(s.admit(1, &p1, 4));
    step(&mut s, &mut b);
    let mut p2 = p1[..8].to_vec();
    p2.push(70);
    assert!(s.admit(2, &p2, 4));
    step(&mut s, &mut b); // 2 shares sequence 1's first two blocks
    assert_eq!(s.reused_tokens(), 8);
    assert!(s.finish(2));
    // Sequence 2's entry holds positions 0..10 (two shared blocks and
    // its own). A prompt sharing 6 of them would resume inside the
    // second block, which sequence 1 still reads: the entry gives 4.
    let mut p3 = p1[..6].to_vec();
    p3.extend([80, 81]);
    assert!(s.admit(3, &p3, 4));
    assert_eq!(s.reused_tokens(), 8 + 4);
    // Its first step copies sequence 1's second block into its own and
    // feeds it from position 6.
    let one: Vec<i32> = {
        let plan = step(&mut s, &mut b);
        let row = plan.iter().position(|p| p.id == 3).expect("planned");
        assert_eq!(b.seq_table()[5 * row + 2], 6, "fed from position 6");
        let r1 = plan.iter().position(|p| p.id == 1).expect("planned");
        let off = |r: usize| b.seq_table()[5 * r + 3] as usize;
        let (o1, o3) = (off(r1), off(row));
        assert_eq!(b.block_table()[o3], b.block_table()[o1], "block 0 shared");
        assert_ne!(b.block_table()[o3 + 1], b.block_table()[o1 + 1]);
        vec![b.block_table()[o1 + 1], b.block_table()[o3 + 1]]
    };
    assert_eq!(b.copy_table(), one);
    assert_eq!(s.reused_tokens(), 8 + 6);
    for id in [1, 3] {
        assert!(s.remove(id));
    }
    s.clear_cache();
    assert_eq!((s.kv_used(), s.kv_cached()), (0, 0));
}

#[test]
fn a_waiting_sequence_takes_the_prompt_its_donor_left_in_the_cache() {
    // Blocks of 4. Sequences 1 and 2 arrive together with the same 10
    // tokens: 2 waits while 1 feeds them; 1 ends on its first sampled
    // token (an `n` choice stopping at once) before 2 has started.
    let mut s = sched(4, 64, 16);
    let mut b = Batch::default();
    let p: Vec<u32> = (1..=10).collect();
    assert!(s.admit(1, &p, 4));
    assert!(s.admit(2, &p, 4));
    let plan = step(&mut s, &mut b);
    assert_eq!(plan.iter().map(|x| x.id).collect::<Vec<_>>(), [1]);
    assert!(s.finish(1));
    // 2 reads the entry's two whole blocks, copies the third (positions
    // 8..9) into its own, and feeds its last prompt token alone.
    let plan = step(&mut s, &mut b);
    assert_eq!(
        plan,
        [Slot {
            id: 2,
            tokens: 1,
            samples: true
        }]
    );
    assert_eq!(b.seq_table()[2], 9, "fed from position 9");
    assert_eq!((s.reused_of(2), s.reused_tokens()), (9, 9));
    assert_eq!(b.copy_table().len(), 2, "one block copied");
    // The entry stays in the cache; its blocks are freed only when
    // both let go.
    assert!(s.finish(2));
    s.clear_cache();
    assert_eq!((s.kv_used(), s.kv_cached()), (0, 0));
    assert!(s.can_admit(16 * 4 - 4), "every block is free again");
}

#[test]
fn a_short_pool_preempts_the_youngest_and_feeds_it_again() {
    // 6 blocks of 4 positions; two sequences of 8-token prompts that
    // each want 8 more tokens: 16 positions each, 32 in all, 24 held.
    let mut s = sched(2, 64, 6);
    let mut b = Batch::default();
    assert!(s.admit(1, &[1; 8], 8));
    assert!(s.admit(2, &[2; 8], 8));
    let mut fed: Vec<(SeqId, usize, usize)> = Vec::new();
    let mut done = Vec::new();
    for _ in 0..64 {
        if s.is_idle() {
            break;
        }
        let plan = s.schedule(&mut b).to_vec();
        // Every block table entry is a distinct block.
        let mut ids = b.block_table().to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), b.block_table().len(), "blocks are never shared");
        s.advance();
        for (j, p) in plan.iter().enumerate() {
            let row = &b.seq_table()[5 * j..5 * j + 5];
            fed.push((p.id, row[2] as usize, p.tokens));
            if p.samples && !s.push_token(p.id, 7) {
                done.push(p.id);
                s.remove(p.id);
            }
        }
    }
    assert!(s.preemptions() > 0, "the pool was short");
    done.sort_unstable();
    assert_eq!(done, [1, 2], "both finished");
    // Sequence 2 was fed again from position 0 after its preemption.
    let restarts = fed
        .iter()
        .filter(|&&(id, start, _)| id == 2 && start == 0)
        .count();
    assert_eq!(restarts, 1 + s.preemptions() as usize);
    assert_eq!(s.kv_used(), 0);
}

#[test]
fn guesses_ride_with_their_token_are_rolled_back_and_never_preempt() {
    // 6 blocks of 4 positions; two sequences of 6 prompt tokens.
    let mut s = sched(2, 16, 6);
    let mut b = Batch::default();
    assert!(s.admit(1, &[1; 6], 12));
    assert!(!s.set_draft(1, &[7]), "not decoding yet");
    assert!(s.admit(2, &[2; 6], 12));
    step(&mut s, &mut b);
    assert_eq!(s.kv_used(), 16);
    // Sequence 1 feeds its newest token and 4 guesses, with a row for
    // each; sequence 2 its one token.
    assert!(s.set_draft(1, &[7, 8, 9, 10]));
    assert_eq!(s.decoding(1), Some(&[1, 1, 1, 1, 1, 1, 101][..]));
    let plan = s.schedule(&mut b).to_vec();
    assert_eq!(
        plan,
        [
            Slot {
                id: 1,
                tokens: 5,
                samples: true
            },
            Slot {
                id: 2,
                tokens: 1,
                samples: true
            }
        ]
    );
    assert_eq!(&b.tokens()[..5], &[101, 7, 8, 9, 10]);
    assert_eq!((b.logit_rows_of(0), b.logit_rows_of(1)), (0..5, 5..6));
    assert_eq!(s.kv_used(), 20, "a block for the guessed positions");
    s.advance();
    // No guess was kept: the block past the kept positions goes back.
    s.push_token(1, 50);
    s.push_token(2, 102);
    s.rollback(1);
    s.rollback(2);
    assert_eq!(s.kv_used(), 16);
    assert_eq!(s.decoding(1), Some(&[1, 1, 1, 1, 1, 1, 101, 50][..]));
    // Two guesses kept, then a third token sampled: positions up to
    // the newest token stay.
    assert!(s.set_draft(1, &[7, 8, 9]));
    s.schedule(&mut b);
    s.advance();
    for t in [7, 8, 60] {
        s.push_token(1, t);
    }
    s.push_token(2, 102);
    s.rollback(1);
    s.rollback(2);
    assert_eq!(s.decoding(1).map(<[u32]>::len), Some(11));
    assert_eq!(s.kv_used(), 20);
    // One block is free and sequence 2 needs it for its next token:
    // sequence 1's guesses would take it and preempt sequence 2, so
    // they are dropped and it feeds its newest token alone.
    assert!(s.set_draft(1, &[1, 2]));
    let plan = s.schedule(&mut b).to_vec();
    assert_eq!(plan.len(), 2);
    assert_eq!(plan[0].tokens, 1);
    assert_eq!(b.tokens()[0], 60);
    assert_eq!(s.preemptions(), 0);
}

#[test]
fn window_rings_are_per_sequence_and_prefixes_are_not_reused() {
    // Window 4, steps of at most 6 tokens, blocks of 4: rings of 4 blocks.
    let ring = WindowRing::new(4, 6, 4);
    let mut s = sched(2, 6, 32).with_window(ring);
    let mut batch = Batch::with_capacity(6, 2, 32);
    let prompt = [1u32, 2, 3, 4, 5, 6, 7, 8, 9];
    assert!(s.admit(0, &prompt, 4));
    assert!(s.admit(1, &prompt, 4));
    let free = |s: &Scheduler| s.window.as_ref().map(|(_, p)| p.free_blocks());
    assert_eq!(free(&s), Some(0), "two rings of 4 fill the pool of 8");
    step(&mut s, &mut batch);
    // Each sequence's window entries are its own ring's blocks, in
    // position order modulo the ring.
    let (t, w) = (batch.seq_table(), batch.window_block_table());
    assert_eq!(w.len(), batch.block_table().len());
    let ring_of = |j: usize| {
        let (off, n) = (
            t[5 * j + 3] as usize,
            t[5 * j + 1] as usize + t[5 * j + 2] as usize,
        );
        w[off..off + n.div_ceil(4)].to_vec()
    };
    let a = ring_of(0);
    assert!(a.iter().all(|b| (0..8).contains(b)));
    // The second sequence did not share the first one's prompt blocks.
    assert_eq!(s.reused_tokens(), 0);
    assert!(s.finish(0));
    assert_eq!(free(&s), Some(4), "a finished sequence's ring goes back");
    assert_eq!(s.kv_cached(), 0, "and nothing is kept for reuse");
    assert!(s.admit(2, &prompt, 4));
    assert_eq!(s.reused_of(2), 0);
    assert!(s.remove(1) && s.remove(2));
    assert_eq!(free(&s), Some(8));
}
