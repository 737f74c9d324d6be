//! One step of the schedule: the kernel call of each op, with its operands
//! resolved from the step's locations (arena, weights, caches, inputs).

use super::*;

impl Executor {
    fn weight(&self, loc: Loc) -> Result<WeightRef<'_>, RunError> {
        match loc {
            Loc::Weight(w) => {
                let t = &self.weights[w];
                Ok(WeightRef::new(t.dtype, t.data.as_bytes()).with_layout(self.layouts[w]))
            }
            _ => Err(RunError::Unsupported("expected a weight operand".into())),
        }
    }

    pub(super) fn run_step(
        &mut self,
        i: usize,
        arena: ArenaPtr,
        batch: &Batch,
        hidden: &[f32],
        (seqs, window_seqs): (&StepSeqs<'_>, Option<&StepSeqs<'_>>),
        b: &Bindings,
    ) -> Result<(), RunError> {
        let st = &self.steps[i];
        let s_n = b.s;
        // A window layer that keeps only its window reads and writes its
        // own pool, through the window block table and slots.
        let (geom, kv_seqs) = if st.windowed {
            match (self.window_geom, window_seqs) {
                (Some(g), Some(w)) => (g, w),
                _ => {
                    return Err(RunError::Unsupported(
                        "a window layer's pool has no block table in this step".into(),
                    ))
                }
            }
        } else {
            (self.geom, seqs)
        };
        // Integer step inputs.
        let ints = |k: usize| -> Result<&[i32], RunError> {
            match st.ins[k].0 {
                Loc::Input(StepInput::Tokens) => Ok(batch.tokens()),
                Loc::Input(StepInput::Positions) => Ok(&self.positions[..s_n]),
                Loc::Input(StepInput::KvSlots) => Ok(&self.slots[..s_n]),
                Loc::Input(StepInput::SeqTable) => Ok(batch.seq_table()),
                Loc::Input(StepInput::BlockTable) => Ok(batch.block_table()),
                Loc::Input(StepInput::WindowSlots) => Ok(&self.window_slots[..s_n]),
                Loc::Input(StepInput::WindowBlockTable) => Ok(batch.window_block_table()),
                _ => Err(RunError::Unsupported("expected a step input".into())),
            }
        };
        let pool = &self.pool;
        // The table of kernels and how matmuls treat activations.
        let how = (self.kernels, self.matmul_mode);
        #[allow(clippy::too_many_arguments)]
        fn matmul(
            pool: &ThreadPool,
            x: &[f32],
            s: usize,
            k: usize,
            w: WeightRef<'_>,
            n: usize,
            e: Epilogue<'_>,
            y: &mut [f32],
            (kernels, mode): (&Kernels, MatmulMode),
        ) -> Result<(), KernelError> {
            kernels.matmul_any(
                pool,
                crate::kernels::LinearArgs::new(x, s, k, w, n, e),
                y,
                mode,
            )
        }
        let numel = |sh: &Shape| sh.numel(b);
        let dim = |sh: &Shape, k: usize| sh.dims()[k].eval(b);
        let out_len = numel(&st.shape);
        // SAFETY (for every arena slice below): the plan gives each buffer
        // that is live at this step its own byte range (checked by
        // `BufferPlan::check`), so the output never overlaps an input except
        // in place, where the input slice is not created.
        let input = |k: usize| -> Result<&[f32], RunError> {
            match st.ins[k].0 {
                Loc::Arena(off) => Ok(unsafe { arena.slice(off, numel(&st.ins[k].1)) }),
                _ => Err(RunError::Unsupported(
                    "expected an activation operand".into(),
                )),
            }
        };
        // Copies input 0 into the output unless they are the same buffer,
        // so in-place kernels can run on the output.
        let out_from_input0 = || -> Result<&mut [f32], RunError> {
            let Loc::Arena(o) = st.out else {
                return Err(RunError::Unsupported("output is not an activation".into()));
            };
            let out = unsafe { arena.slice_mut(o, out_len) };
            if st.ins[0].0 != st.out {
                out.copy_from_slice(input(0)?);
            }
            Ok(out)
        };
        let out_fresh = || -> Result<&mut [f32], RunError> {
            let Loc::Arena(o) = st.out else {
                return Err(RunError::Unsupported("output is not an activation".into()));
            };
            Ok(unsafe { arena.slice_mut(o, out_len) })
        };
        match &st.op {
            Op::Embedding => {
                let table = self.weight(st.ins[0].0)?;
                let (vocab, dim_e) = (dim(&st.ins[0].1, 0), dim(&st.ins[0].1, 1));
                kernels::embedding_any(table, vocab, dim_e, ints(1)?, out_fresh()?)?;
            }
            Op::RopeFreqs(p) => {
                let RopeParams {
                    head_dim,
                    theta,
                    scaling,
                } = *p;
                let positions = ints(0)?;
                kernels::dispatch::rope_fill_freqs(
                    out_fresh()?,
                    positions,
                    head_dim,
                    theta as f32,
                    scaling,
                )?;
            }
            Op::GatherRows => {
                let Loc::Table(t) = st.ins[0].0 else {
                    return Err(RunError::Unsupported(
                        "rows are gathered from a RoPE table only".into(),
                    ));
                };
                self.tables[t].gather(ints(1)?, out_fresh()?)?;
            }
            Op::RmsNorm { eps } => {
                let d = dim(&st.shape, st.shape.rank() - 1);
                kernels::rmsnorm(input(0)?, d, None, *eps as f32, out_fresh()?)?;
            }
            Op::MatMul | Op::OutputHead => {
                let (xs, ws) = (&st.ins[0].1, &st.ins[1].1);
                let k = dim(xs, 1);
                let n = dim(ws, 0);
                let x = input(0)?;
                let s = dim(xs, 0);
                let w = self.weight(st.ins[1].0)?;
                matmul(pool, x, s, k, w, n, Epilogue::None, out_fresh()?, how)?;
            }
            Op::MatMulAdd => {
                let (xs, ws) = (&st.ins[1].1, &st.ins[2].1);
                let (s, k, n) = (dim(xs, 0), dim(xs, 1), dim(ws, 0));
                let w = self.weight(st.ins[2].0)?;
                let x = input(1)?;
                if st.ins[0].0 == st.out {
                    matmul(pool, x, s, k, w, n, Epilogue::Accumulate, out_fresh()?, how)?;
                } else {
                    let r = input(0)?;
                    matmul(
                        pool,
                        x,
                        s,
                        k,
                        w,
                        n,
                        Epilogue::AddResidual(r),
                        out_fresh()?,
                        how,
                    )?;
                }
            }
            Op::MatMulSwiGlu => {
                let (xs, ws) = (&st.ins[0].1, &st.ins[1].1);
                let (s, k, n) = (dim(xs, 0), dim(xs, 1), dim(ws, 0));
                let w = self.weight(st.ins[1].0)?;
                matmul(
                    pool,
                    input(0)?,
                    s,
                    k,
                    w,
                    n,
                    Epilogue::SwiGlu,
                    out_fresh()?,
                    how,
                )?;
            }
            Op::SliceCols { start, len } => {
                let n = dim(&st.ins[0].1, 1);
                let x = input(0)?;
                let out = out_fresh()?;
                for (o, xr) in out.chunks_exact_mut(*len).zip(x.chunks_exact(n)) {
                    o.copy_from_slice(&xr[*start..*start + *len]);
                }
            }
            Op::LastRows => {
                let e = dim(&st.ins[0].1, 1);
                let x = input(0)?;
                let out = out_fresh()?;
                let mut rows = out.chunks_exact_mut(e);
                for sq in seqs.iter() {
                    let end = sq.first + sq.count;
                    // The token range leads the zip: when it ends, no
                    // output row has been taken (and lost) for it.
                    for (t, o) in (end - sq.rows..end).zip(rows.by_ref()) {
                        o.copy_from_slice(&x[t * e..(t + 1) * e]);
                    }
                }
            }
            Op::PoolRows { pooling } => {
                let e = dim(&st.ins[0].1, 1);
                let x = input(0)?;
                let out = out_fresh()?;
                for (sq, o) in seqs.iter().zip(out.chunks_exact_mut(e)) {
                    if sq.start != 0 {
                        return Err(RunError::Unsupported(format!(
                            "pooling needs a whole sequence in one step; this one starts at position {}",
                            sq.start
                        )));
                    }
                    let rows = &x[sq.first * e..(sq.first + sq.count) * e];
                    match pooling {
                        Pooling::Cls => o.copy_from_slice(&rows[..e]),
                        Pooling::Last => o.copy_from_slice(&rows[rows.len() - e..]),
                        Pooling::Mean => {
                            // Rows summed in position order, then scaled:
                            // the same bits whatever else the step holds.
                            o.fill(0.0);
                            for r in rows.chunks_exact(e) {
                                for (a, &v) in o.iter_mut().zip(r) {
                                    *a += v;
                                }
                            }
                            let inv = 1.0 / sq.count as f32;
                            o.iter_mut().for_each(|a| *a *= inv);
                        }
                    }
                }
            }
            Op::RmsNormScaled { eps } => {
                let d = dim(&st.shape, st.shape.rank() - 1);
                let Loc::Weight(w) = st.ins[1].0 else {
                    return Err(RunError::Unsupported(
                        "the norm weight must be a weight".into(),
                    ));
                };
                let v = self
                    .vectors
                    .get(&w)
                    .ok_or_else(|| RunError::Unsupported("norm weight is not a vector".into()))?;
                let wr = kernels::WeightRef::from_f32(v);
                kernels::rmsnorm(input(0)?, d, Some(wr), *eps as f32, out_fresh()?)?;
            }
            Op::Attention { n_rep, window, .. } => {
                let (n_rep, window) = (*n_rep, *window);
                let (Loc::Cache(ck), Loc::Cache(cv)) = (st.ins[1].0, st.ins[2].0) else {
                    return Err(RunError::Unsupported(
                        "attention reads the two caches".into(),
                    ));
                };
                let d = geom.head_dim;
                // Multiply-adds of q·K and p·V: below the threshold the call
                // is cheaper on this thread than a hand-off to the pool.
                // (A windowed query reads at most its window.)
                let keys = |q: &kernels::SeqSpan<'_>| {
                    q.keys().min(window.map_or(usize::MAX, |w| w + q.count))
                };
                let work: usize = kv_seqs.iter().map(|q| q.count * keys(&q)).sum::<usize>()
                    * 2
                    * geom.n_kv_heads
                    * n_rep
                    * d;
                let pool = if work <= self.serial_attention_work {
                    &self.serial
                } else {
                    pool
                };
                let q = input(0)?;
                let out = out_fresh()?;
                let attn = self
                    .attn_work
                    .as_mut()
                    .ok_or_else(|| RunError::Unsupported("no attention scratch".into()))?;
                (self.kernels.attention)(
                    pool,
                    q,
                    self.caches[ck].view(),
                    self.caches[cv].view(),
                    &geom,
                    n_rep,
                    window,
                    kv_seqs,
                    out,
                    attn,
                )?;
            }
            Op::QkvRopeCache {
                n_heads,
                n_kv_heads,
                head_dim,
                bias,
                qk_norm,
            } => {
                let (h, hkv, d) = (*n_heads, *n_kv_heads, *head_dim);
                let vector = |k: usize| -> Result<&[f32], RunError> {
                    let Loc::Weight(w) = st.ins[k].0 else {
                        return Err(RunError::Unsupported("expected a weight vector".into()));
                    };
                    self.vectors
                        .get(&w)
                        .map(Vec::as_slice)
                        .ok_or_else(|| RunError::Unsupported("not a vector weight".into()))
                };
                // The biases of q, k, v (one vector each), then the q and k
                // norm weights.
                let biases = if *bias {
                    Some([vector(6)?, vector(7)?, vector(8)?])
                } else {
                    None
                };
                let nb = if *bias { 9 } else { 6 };
                let norms = match qk_norm {
                    Some(eps) => Some((vector(nb)?, vector(nb + 1)?, *eps as f32)),
                    None => None,
                };
                let (xs, ws) = (&st.ins[0].1, &st.ins[1].1);
                let (s, k, n) = (dim(xs, 0), dim(xs, 1), dim(ws, 0));
                let Loc::Arena(xo) = st.ins[0].0 else {
                    return Err(RunError::Unsupported("x must be an activation".into()));
                };
                let Loc::Weight(wi) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("expected a weight operand".into()));
                };
                let (Loc::Cache(ck), Loc::Cache(cv)) = (st.ins[3].0, st.ins[4].0) else {
                    return Err(RunError::Unsupported("expected the two caches".into()));
                };
                let Loc::Arena(o) = st.out else {
                    return Err(RunError::Unsupported("output is not an activation".into()));
                };
                let Loc::Arena(fo) = st.ins[2].0 else {
                    return Err(RunError::Unsupported("bad RoPE angles operand".into()));
                };
                if ck == cv || (hkv, d) != (geom.n_kv_heads, geom.head_dim) {
                    return Err(RunError::Unsupported(
                        "the step does not fit the caches".into(),
                    ));
                }
                let slots = ints(5)?;
                // SAFETY: x, the angles and the output are distinct live
                // buffers of the plan.
                let x = unsafe { arena.slice(xo, s * k) };
                let freqs = unsafe { arena.slice(fo, s * d) };
                let q_out = unsafe { arena.slice_mut(o, s * h * d) };
                let t = &self.weights[wi];
                let w = WeightRef::new(t.dtype, t.data.as_bytes()).with_layout(self.layouts[wi]);
                let (qn, kn) = (h * d, hkv * d);
                let (lo, hi) = self.caches.split_at_mut(ck.max(cv));
                let (kc, vc) = if ck < cv {
                    (&mut lo[ck], &mut hi[0])
                } else {
                    (&mut hi[0], &mut lo[cv])
                };
                // The packed product goes through a scratch of at most
                // QKV_BLOCK tokens; each token's q goes to the output, its
                // keys are rotated and, with its values, written to its KV
                // slot; then q is rotated.
                for t0 in (0..s).step_by(QKV_BLOCK) {
                    let sb = QKV_BLOCK.min(s - t0);
                    let y = &mut self.qkv_scratch[..sb * n];
                    let xb = &x[t0 * k..(t0 + sb) * k];
                    matmul(pool, xb, sb, k, w, n, Epilogue::None, y, how)?;
                    for (i, row) in y.chunks_exact_mut(n).enumerate() {
                        let t = t0 + i;
                        let f = &freqs[t * d..(t + 1) * d];
                        if let Some([bq, bk, bv]) = biases {
                            // The same f32 adds as the unfused `Add`s.
                            let (rq, rest) = row.split_at_mut(qn);
                            let (rk, rv) = rest.split_at_mut(kn);
                            kernels::add_inplace(rq, bq)?;
                            kernels::add_inplace(rk, bk)?;
                            kernels::add_inplace(&mut rv[..kn], bv)?;
                        }
                        q_out[t * qn..(t + 1) * qn].copy_from_slice(&row[..qn]);
                        let krow = &mut row[qn..qn + kn];
                        if let Some((_, kw, eps)) = norms {
                            rms_norm_heads(krow, d, kw, eps)?;
                        }
                        kernels::dispatch::rope_apply_freqs(krow, 1, hkv, d, f)?;
                        let slot = slots[t] as usize;
                        kernels::kv::kv_write_row(kc, KvHalf::K, &geom, slot, krow)?;
                        let vrow = &row[qn + kn..qn + 2 * kn];
                        kernels::kv::kv_write_row(vc, KvHalf::V, &geom, slot, vrow)?;
                    }
                }
                if let Some((qw, _, eps)) = norms {
                    rms_norm_heads(q_out, d, qw, eps)?;
                }
                kernels::dispatch::rope_apply_freqs(q_out, s, h, d, freqs)?;
            }
            Op::Rope => {
                let (s, h, d) = (dim(&st.shape, 0), dim(&st.shape, 1), dim(&st.shape, 2));
                let freqs = input(1)?;
                kernels::dispatch::rope_apply_freqs(out_from_input0()?, s, h, d, freqs)?;
            }
            Op::KvWrite => {
                let Loc::Cache(c) = st.ins[0].0 else {
                    return Err(RunError::Unsupported("KvWrite needs a cache".into()));
                };
                let Loc::Arena(xo) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("KvWrite reads an activation".into()));
                };
                // SAFETY: the input buffer is live and not written by this step.
                let x = unsafe { arena.slice(xo, numel(&st.ins[1].1)) };
                let half = if c % 2 == 0 { KvHalf::K } else { KvHalf::V };
                let slots = ints(2)?;
                kernels::kv_write_rows(&mut self.caches[c], half, &geom, slots, x)?;
            }
            Op::AttnScores { n_rep, window, .. } => {
                let Loc::Cache(c) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("attention reads a cache".into()));
                };
                let cache = self.caches[c].view();
                let t = b.t;
                let x = input(0)?;
                let out = out_fresh()?;
                kernels::attn_scores_windowed(
                    pool, x, cache, &geom, *n_rep, kv_seqs, t, *window, out,
                )?;
            }
            Op::AttnValues { n_rep } => {
                let Loc::Cache(c) = st.ins[1].0 else {
                    return Err(RunError::Unsupported("attention reads a cache".into()));
                };
                let cache = self.caches[c].view();
                let t = b.t;
                let x = input(0)?;
                let out = out_fresh()?;
                kernels::attn_values(pool, x, cache, &geom, *n_rep, kv_seqs, t, out)?;
            }
            Op::Softmax => {
                let row = dim(&st.shape, st.shape.rank() - 1);
                kernels::softmax_rows(pool, out_from_input0()?, row)?;
            }
            Op::Silu => kernels::dispatch::silu_inplace(out_from_input0()?),
            Op::GeluTanh => kernels::elementwise::gelu::gelu_tanh_inplace_at(
                self.kernels.isa(),
                pool,
                out_from_input0()?,
            ),
            Op::Scale { factor } => kernels::scale_inplace(out_from_input0()?, *factor as f32),
            Op::Add => match st.ins[1].0 {
                Loc::Weight(w) => {
                    // A bias, broadcast over rows.
                    let v = self
                        .vectors
                        .get(&w)
                        .ok_or_else(|| RunError::Unsupported("Add of a matrix weight".into()))?;
                    let out = out_from_input0()?;
                    if v.is_empty() || !out.len().is_multiple_of(v.len()) {
                        return Err(RunError::Unsupported(
                            "bias length does not divide the rows".into(),
                        ));
                    }
                    for row in out.chunks_exact_mut(v.len()) {
                        kernels::add_inplace(row, v)?;
                    }
                }
                _ => {
                    let bsl = input(1)?;
                    kernels::add_inplace(out_from_input0()?, bsl)?;
                }
            },
            Op::Mul => match st.ins[1].0 {
                Loc::Weight(w) => {
                    let v = self
                        .vectors
                        .get(&w)
                        .ok_or_else(|| RunError::Unsupported("Mul by a matrix weight".into()))?;
                    kernels::dispatch::mul_broadcast_inplace(out_from_input0()?, v)?;
                }
                _ => {
                    let bsl = input(1)?;
                    kernels::dispatch::mul_inplace(out_from_input0()?, bsl)?;
                }
            },
            Op::Recv { from } => {
                let out = out_fresh()?;
                if hidden.len() != out.len() {
                    return Err(RunError::Unsupported(format!(
                        "this stage reads the hidden state stage {from} sent: {} values for {} tokens, got {}",
                        out.len(),
                        b.s,
                        hidden.len()
                    )));
                }
                out.copy_from_slice(hidden);
            }
            Op::Tokens
            | Op::Positions
            | Op::KvSlots
            | Op::SeqTable
            | Op::BlockTable
            | Op::WindowSlots
            | Op::WindowBlockTable
            | Op::Weight { .. }
            | Op::KvCache { .. }
            | Op::Reshape
            | Op::RopeTable { .. }
            | Op::Send { .. } => {}
        }
        Ok(())
    }
}

/// RMS-normalises each `d`-sized head of `x` in place, times `w` (`[d]`):
/// the same kernel (and so the same bits) as the unfused `RmsNorm` + `Mul`
/// pair folded into `RmsNormScaled`.
fn rms_norm_heads(x: &mut [f32], d: usize, w: &[f32], eps: f32) -> Result<(), KernelError> {
    let mut head = [0f32; 512];
    if d > head.len() {
        return Err(KernelError::Invalid {
            op: "qk_norm",
            what: "head_dim above 512",
        });
    }
    let wr = kernels::WeightRef::from_f32(w);
    for hx in x.chunks_exact_mut(d) {
        head[..d].copy_from_slice(hx);
        kernels::rmsnorm(&head[..d], d, Some(wr), eps, hx)?;
    }
    Ok(())
}

pub(super) enum RunError {
    Kernel(KernelError),
    Unsupported(String),
}

impl From<KernelError> for RunError {
    fn from(e: KernelError) -> Self {
        RunError::Kernel(e)
    }
}
