//! The issue half of the GPU cost model: what one wave executes per 32-token block in the steady
//! state of a long decode, counted in the gfx1201 disassembly of the issue model's probes
//! (`hipkv::kernels::probe_objects`, attention.hip's `probe_block`), and what that predicts
//! against the time the block's bytes take at the card's bandwidth.
//!
//! A probe is the attention kernel's own block code (scores, online softmax, values), compiled
//! with every loop unrolled but the token loop of the values. So its control flow is a straight
//! line, forward branches that skip lanes, and one loop that runs once per token of the block:
//! the executed count of an instruction is 1, or the block's tokens inside that loop. The
//! loop is found as LLVM finds loops (natural loops of the control-flow graph's back edges), and
//! a probe with any other shape is an error, not a guess.

use std::collections::BTreeMap;

use hipkv::cost::MemoryReport;

use crate::census::Census;

/// Tokens of the probe's block: one run of a wave, the default page (`G = 32`).
pub const BLOCK_TOKENS: usize = hipkv::abi::HIPKV_WAVE as usize;

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("{function}: a branch at {at:#x} targets {target:#x}, which no instruction starts at")]
    Target {
        function: String,
        at: u64,
        target: u64,
    },
    #[error("no issue-model probe of {0} was built")]
    NoProbe(String),
    #[error(
        "{function}: a branch at {at:#x} decides on a wave-uniform condition outside the token \
         loop, so the probe would count a path the wave does not take"
    )]
    UniformBranch { function: String, at: u64 },
    #[error(
        "{function}: {loops} loops where the issue model expects exactly one (the token loop of \
         the values)"
    )]
    Loops { function: String, loops: usize },
}

/// One instruction of a disassembled function.
#[derive(Debug)]
struct Instruction {
    address: u64,
    mnemonic: String,
    /// A branch's target address.
    target: Option<u64>,
}

impl Instruction {
    /// No instruction after it in the function runs next: an unconditional jump or an end.
    fn ends_flow(&self) -> bool {
        self.mnemonic == "s_branch"
            || self.mnemonic.starts_with("s_endpgm")
            || self.mnemonic == "s_setpc_b64"
    }
}

/// A function of `llvm-objdump -d` output, its instructions in address order.
#[derive(Debug)]
pub struct Function {
    pub name: String,
    instructions: Vec<Instruction>,
}

/// Every function in `llvm-objdump -d` output. An instruction line ends with a comment holding
/// its address (`// 000000015E04: F4004E00`), and a branch's line with its target as an offset
/// into the function (`<name+0x3b0>`).
pub fn functions(disassembly: &str) -> Vec<Function> {
    let mut out: Vec<(u64, Function)> = Vec::new();
    for line in disassembly.lines() {
        if let Some((base, name)) = line
            .split_once(" <")
            .and_then(|(addr, rest)| Some((u64::from_str_radix(addr, 16).ok()?, rest)))
            .and_then(|(base, rest)| Some((base, rest.strip_suffix(">:")?)))
        {
            let function = Function {
                name: name.to_string(),
                instructions: Vec::new(),
            };
            out.push((base, function));
        } else if let (Some(body), Some((base, function))) =
            (line.strip_prefix('\t'), out.last_mut())
            && let Some(mnemonic) = body.split_whitespace().next()
            && let Some(address) = body
                .split_once("// ")
                .and_then(|(_, c)| c.split_once(':'))
                .and_then(|(a, _)| u64::from_str_radix(a, 16).ok())
        {
            let target = body.rsplit_once(" <").and_then(|(_, t)| {
                let t = t.strip_suffix('>')?;
                match t.split_once("+0x") {
                    Some((_, offset)) => Some(*base + u64::from_str_radix(offset, 16).ok()?),
                    None => Some(*base),
                }
            });
            function.instructions.push(Instruction {
                address,
                mnemonic: mnemonic.to_string(),
                target,
            });
        }
    }
    out.into_iter().map(|(_, f)| f).collect()
}

/// The control-flow graph of a function: basic blocks as instruction ranges, with successors.
struct Graph {
    blocks: Vec<std::ops::Range<usize>>,
    successors: Vec<Vec<usize>>,
}

impl Graph {
    fn of(f: &Function) -> Result<Graph, IssueError> {
        let ins = &f.instructions;
        let index: BTreeMap<u64, usize> = ins
            .iter()
            .enumerate()
            .map(|(i, x)| (x.address, i))
            .collect();
        let target_of = |i: usize| -> Result<Option<usize>, IssueError> {
            let Some(target) = ins[i].target else {
                return Ok(None);
            };
            index
                .get(&target)
                .copied()
                .map(Some)
                .ok_or(IssueError::Target {
                    function: f.name.clone(),
                    at: ins[i].address,
                    target,
                })
        };
        let is_branch = |x: &Instruction| x.mnemonic.starts_with("s_cbranch") || x.ends_flow();
        let mut starts = vec![false; ins.len() + 1];
        starts[0] = true;
        for (i, x) in ins.iter().enumerate() {
            if let Some(t) = target_of(i)? {
                starts[t] = true;
            }
            if is_branch(x) {
                starts[i + 1] = true;
            }
        }
        let first: Vec<usize> = (0..ins.len()).filter(|&i| starts[i]).collect();
        let blocks: Vec<_> = first
            .iter()
            .zip(first.iter().skip(1).copied().chain([ins.len()]))
            .map(|(&s, e)| s..e)
            .collect();
        let block_of: BTreeMap<usize, usize> =
            first.iter().enumerate().map(|(b, &i)| (i, b)).collect();
        let mut successors = Vec::with_capacity(blocks.len());
        for (b, range) in blocks.iter().enumerate() {
            let last = range.end - 1;
            let mut next = Vec::new();
            if let Some(t) = target_of(last)? {
                next.push(block_of[&t]);
            }
            if !ins[last].ends_flow() && b + 1 < blocks.len() {
                next.push(b + 1);
            }
            successors.push(next);
        }
        Ok(Graph { blocks, successors })
    }

    /// The blocks reachable from the entry, in reverse postorder.
    fn reverse_postorder(&self) -> Vec<usize> {
        let mut seen = vec![false; self.blocks.len()];
        let mut order = Vec::new();
        let mut stack = vec![(0usize, 0usize)];
        seen[0] = true;
        while let Some((b, i)) = stack.pop() {
            if let Some(&s) = self.successors[b].get(i) {
                stack.push((b, i + 1));
                if !seen[s] {
                    seen[s] = true;
                    stack.push((s, 0));
                }
            } else {
                order.push(b);
            }
        }
        order.reverse();
        order
    }

    /// Each block's predecessors among the reachable blocks `rpo`.
    fn predecessors(&self, rpo: &[usize]) -> Vec<Vec<usize>> {
        let mut predecessors = vec![Vec::new(); self.blocks.len()];
        for &b in rpo {
            for &s in &self.successors[b] {
                predecessors[s].push(b);
            }
        }
        predecessors
    }

    /// Each reachable block's immediate dominator (the entry's is itself), by Cooper, Harvey
    /// and Kennedy's iteration over the reverse postorder.
    fn dominators(&self, rpo: &[usize]) -> Vec<Option<usize>> {
        let mut rank = vec![usize::MAX; self.blocks.len()];
        for (r, &b) in rpo.iter().enumerate() {
            rank[b] = r;
        }
        let predecessors = self.predecessors(rpo);
        let mut idom: Vec<Option<usize>> = vec![None; self.blocks.len()];
        idom[rpo[0]] = Some(rpo[0]);
        let intersect = |idom: &[Option<usize>], mut a: usize, mut b: usize| {
            while a != b {
                while rank[a] > rank[b] {
                    a = idom[a].expect("processed");
                }
                while rank[b] > rank[a] {
                    b = idom[b].expect("processed");
                }
            }
            a
        };
        let mut changed = true;
        while changed {
            changed = false;
            for &b in &rpo[1..] {
                let mut new = None;
                for &p in &predecessors[b] {
                    if idom[p].is_some() {
                        new = Some(new.map_or(p, |n| intersect(&idom, p, n)));
                    }
                }
                if new.is_some() && idom[b] != new {
                    idom[b] = new;
                    changed = true;
                }
            }
        }
        idom
    }

    /// The natural loops, by header: each back edge's (an edge to a block that dominates its
    /// source) header and the blocks that reach the edge without passing the header.
    fn loops(&self) -> BTreeMap<usize, Vec<bool>> {
        let rpo = self.reverse_postorder();
        let idom = self.dominators(&rpo);
        let dominates = |h: usize, mut b: usize| loop {
            if b == h {
                return true;
            }
            match idom[b] {
                Some(up) if up != b => b = up,
                _ => return false,
            }
        };
        let predecessors = self.predecessors(&rpo);
        let mut loops: BTreeMap<usize, Vec<bool>> = BTreeMap::new();
        for &b in &rpo {
            for &h in &self.successors[b] {
                if !dominates(h, b) {
                    continue;
                }
                let body = loops
                    .entry(h)
                    .or_insert_with(|| vec![false; self.blocks.len()]);
                body[h] = true;
                let mut stack = vec![b];
                while let Some(x) = stack.pop() {
                    if !body[x] {
                        body[x] = true;
                        stack.extend(&predecessors[x]);
                    }
                }
            }
        }
        loops
    }
}

/// What a wave executes for one block of [`BLOCK_TOKENS`] tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Block {
    /// Every instruction executed: the probe's reachable ones, its loop's once per trip.
    pub executed: Census,
    /// One trip of the token loop: the values' accumulation of `HIPKV_VALUE_TOKENS` tokens.
    pub token_loop: Census,
    /// Tokens one trip accumulates.
    pub trip_tokens: usize,
}

/// The probe's [`Block`], its one loop the token loop, whose trips take `trip_tokens` tokens each
/// (`hipkv_value_tokens` of the probe's head_dim).
pub fn block_census(probe: &Function, trip_tokens: usize) -> Result<Block, IssueError> {
    let graph = Graph::of(probe)?;
    let loops = graph.loops();
    let [(_, in_loop)] = loops.iter().collect::<Vec<_>>()[..] else {
        return Err(IssueError::Loops {
            function: probe.name.clone(),
            loops: loops.len(),
        });
    };
    let mut block = Block {
        trip_tokens,
        ..Block::default()
    };
    for b in graph.reverse_postorder() {
        for x in &probe.instructions[graph.blocks[b].clone()] {
            // Outside the loop only branches on the exec mask (lanes skipping a region the
            // others run) may remain: the wave runs the region, and it counts once.
            let uniform = x.mnemonic.starts_with("s_cbranch") && !x.mnemonic.contains("exec");
            if uniform && !in_loop[b] {
                return Err(IssueError::UniformBranch {
                    function: probe.name.clone(),
                    at: x.address,
                });
            }
            if in_loop[b] {
                block
                    .executed
                    .count(&x.mnemonic, BLOCK_TOKENS / trip_tokens);
                block.token_loop.count(&x.mnemonic, 1);
            } else {
                block.executed.count(&x.mnemonic, 1);
            }
        }
    }
    Ok(block)
}

/// The figures of the card the model predicts for.
#[derive(Clone, Copy, Debug)]
pub struct Card {
    pub name: &'static str,
    pub compute_units: usize,
    /// SIMD32 units per compute unit, each issuing at most one VALU instruction per cycle.
    pub simds_per_cu: usize,
    pub clock_ghz: f64,
    pub bandwidth_gbs: f64,
}

impl std::fmt::Display for Card {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} CUs × {} SIMD32 at {} GHz, {} GB/s",
            self.name, self.compute_units, self.simds_per_cu, self.clock_ghz, self.bandwidth_gbs
        )
    }
}

/// The arch of the card `hipkv info --kernels` and the emulator's bench model.
pub const MODEL_ARCH: &str = "gfx1201";

/// AMD's published figures for the RX 9070 XT: 64 compute units and 4096 stream processors
/// (so 2 SIMD32 per CU), a 2.4 GHz game clock (2.97 GHz boost), 20 Gbps GDDR6 on a 256-bit bus
/// (640 GB/s).
pub const RX_9070_XT: Card = Card {
    name: "RX 9070 XT (gfx1201)",
    compute_units: 64,
    simds_per_cu: 2,
    clock_ghz: 2.4,
    bandwidth_gbs: 640.0,
};

/// Where a block's time goes on a card.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Seconds the block's instructions take to issue, over the seconds its fetched bytes take
    /// to read: above 1, the kernel is issue-bound.
    pub issue_per_memory: f64,
    /// The KV bytes' time at full bandwidth over the block's time: the fraction of peak the
    /// kernel reaches in the model.
    pub fraction_of_peak: f64,
}

/// The prediction for one KV head's block: `waves` waves execute `issued` instructions each
/// (one issue cycle apiece on a SIMD, every SIMD of the card busy) while the block's
/// `kv_bytes` are read, `fetch` times over, at the card's bandwidth; the longer of the two is
/// the block's time.
pub fn predict(card: &Card, issued: f64, waves: usize, kv_bytes: f64, fetch: f64) -> Prediction {
    let issue_s = waves as f64 * issued
        / ((card.compute_units * card.simds_per_cu) as f64 * card.clock_ghz * 1e9);
    let bytes_s = kv_bytes / (card.bandwidth_gbs * 1e9);
    let memory_s = bytes_s * fetch;
    Prediction {
        issue_per_memory: issue_s / memory_s,
        fraction_of_peak: bytes_s / issue_s.max(memory_s),
    }
}

/// Waves that read each KV block at GQA `gqa`: one per HIPKV_ROWS query rows.
pub fn waves(gqa: usize, head_dim: usize) -> usize {
    gqa.div_ceil(hipkv::abi::hipkv_rows(head_dim as u32) as usize)
}

/// One kernel's row of the model: its block's instructions beside its memory report.
pub struct Row<'a> {
    pub memory: &'a MemoryReport,
    /// What one wave executes per block (`block_census` of the kernel's probe).
    pub block: Block,
    /// The same with keys scored from the int8 query (`iq`), where the key format has it.
    pub int_query: Option<Block>,
}

impl Row<'_> {
    fn per_token(&self, count: usize) -> f64 {
        count as f64 / BLOCK_TOKENS as f64
    }

    /// KV bytes the step reads per token and KV head.
    fn kv_bytes_per_token(&self) -> f64 {
        self.memory.kv_bytes_per_token()
    }

    /// The prediction at GQA `gqa` for `block` (this row's, or its `iq` one), VALU
    /// instructions issuing (the other classes alongside, from other waves), or every
    /// instruction taking an issue cycle (`single_issue`).
    pub fn predict(
        &self,
        block: &Block,
        card: &Card,
        gqa: usize,
        single_issue: bool,
    ) -> Prediction {
        let c = &block.executed;
        let issued = if single_issue { c.instructions } else { c.valu };
        predict(
            card,
            issued as f64,
            waves(gqa, self.memory.shape.head_dim),
            self.kv_bytes_per_token() * BLOCK_TOKENS as f64,
            self.memory.fetch(),
        )
    }
}

/// Pairs each memory report with its kernel's probe in `probes` (every function of the probe
/// objects' disassembly).
fn rows<'a>(reports: &'a [MemoryReport], probes: &[Function]) -> Result<Vec<Row<'a>>, IssueError> {
    let by_name: BTreeMap<&str, &Function> = probes.iter().map(|f| (f.name.as_str(), f)).collect();
    let census = |name: String, head_dim: usize| match by_name.get(name.as_str()) {
        Some(probe) => block_census(
            probe,
            hipkv::abi::hipkv_value_tokens(head_dim as u32) as usize,
        ),
        None => Err(IssueError::NoProbe(name)),
    };
    reports
        .iter()
        .map(|memory| {
            let pair = memory
                .kernel
                .strip_prefix("hipkv_attn_")
                .ok_or_else(|| IssueError::NoProbe(memory.kernel.clone()))?;
            let int_query = memory.scheme.int_query_applies();
            let head_dim = memory.shape.head_dim;
            Ok(Row {
                memory,
                block: census(format!("hipkv_probe_{pair}"), head_dim)?,
                int_query: match int_query {
                    true => Some(census(format!("hipkv_probe_iq_{pair}"), head_dim)?),
                    false => None,
                },
            })
        })
        .collect()
}

/// Where a prediction puts the kernel, and at what fraction of peak: `mem 100%`, `issue 61%`.
fn verdict(p: Prediction) -> String {
    let bound = if p.issue_per_memory > 1.0 {
        "issue"
    } else {
        "mem"
    };
    format!("{bound} {:.0}%", 100.0 * p.fraction_of_peak)
}

/// One row per kernel: per-token instructions of one wave by class, and the prediction at
/// GQA 4 and 8 on `card`.
pub fn table(rows: &[Row], card: &Card) -> String {
    let width = rows
        .iter()
        .map(|r| r.memory.kernel.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut out = format!(
        "{:width$}  {:>9}  {:>8}  {:>11}  {:>8}  {:>8}  {:>7}  {:>8}  {:>9}  {:>10}  {:>10}  {:>12}  {:>11}  {:>10}\n",
        "kernel",
        "instr/tok",
        "VALU/tok",
        "values VALU",
        "SALU/tok",
        "VMEM/tok",
        "LDS/tok",
        "KV B/tok",
        "VALU/KV B",
        "GQA 4",
        "GQA 8",
        "GQA 8 1-issue",
        "iq VALU/tok",
        "iq GQA 8"
    );
    for r in rows {
        let c = &r.block.executed;
        out += &format!(
            "{:width$}  {:>9.1}  {:>8.1}  {:>11.1}  {:>8.1}  {:>8.2}  {:>7.2}  {:>8.1}  {:>9.2}  {:>10}  {:>10}  {:>12}  {:>11}  {:>10}\n",
            r.memory.kernel,
            r.per_token(c.instructions),
            r.per_token(c.valu),
            r.block.token_loop.valu as f64 / r.block.trip_tokens as f64,
            r.per_token(c.salu),
            r.per_token(c.vmem_load),
            r.per_token(c.lds),
            r.kv_bytes_per_token(),
            r.per_token(c.valu) / r.kv_bytes_per_token(),
            verdict(r.predict(&r.block, card, 4, false)),
            verdict(r.predict(&r.block, card, 8, false)),
            verdict(r.predict(&r.block, card, 8, true)),
            r.int_query.map_or("-".into(), |b| format!(
                "{:.1}",
                r.per_token(b.executed.valu)
            )),
            r.int_query
                .map_or("-".into(), |b| verdict(r.predict(&b, card, 8, false))),
        );
    }
    out
}

/// The model beside `hipkv bench`'s device rows: the probes of one arch, disassembled once, and
/// the card to predict for.
pub struct Predictor {
    probes: Vec<Function>,
    card: Card,
}

impl Predictor {
    /// The probes built for `arch`, disassembled with `tool`; `None` where the build has none.
    /// Each arch's probes have the same names, so one arch is modelled at a time.
    pub fn new(
        tool: &std::path::Path,
        arch: &str,
        card: Card,
    ) -> Result<Option<Predictor>, crate::census::CensusError> {
        let mut probes = Vec::new();
        for object in hipkv::kernels::probe_objects()
            .iter()
            .filter(|o| o.arch == arch)
        {
            probes.extend(functions(&crate::census::disassemble(tool, object)?));
        }
        Ok((!probes.is_empty()).then_some(Predictor { probes, card }))
    }

    pub fn card(&self) -> &Card {
        &self.card
    }

    /// [`rows`] of this arch's probes.
    pub fn rows<'a>(&self, reports: &'a [MemoryReport]) -> Result<Vec<Row<'a>>, IssueError> {
        rows(reports, &self.probes)
    }

    /// The fraction of peak bandwidth the model predicts for the kernel of `scheme`'s key and
    /// value formats at `head_dim` and `gqa`: that pair's steady state (32-channel groups, no
    /// sinks, outliers or windows, whatever the scheme has), with `iq` where the scheme has it.
    pub fn fraction_of_peak(
        &self,
        scheme: &hipkv::Scheme,
        head_dim: usize,
        gqa: usize,
    ) -> Result<f64, crate::CliError> {
        let pair: hipkv::Scheme =
            format!("k={},v={}", scheme.k.kernel_name(), scheme.v.kernel_name()).parse()?;
        let memory = hipkv::cost::memory_report(&pair, hipkv::cost::report_shape(head_dim))?;
        let row = &self.rows(std::slice::from_ref(&memory))?[0];
        let block = match (scheme.int_query, row.int_query) {
            (true, Some(iq)) => iq,
            _ => row.block,
        };
        Ok(row.predict(&block, &self.card, gqa, false).fraction_of_peak)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe in `llvm-objdump -d`'s form: two instructions, a loop of three (its back edge a
    /// conditional branch), a forward branch over one, the end, and padding after it.
    const PROBE: &str = "
0000000000001000 <hipkv_probe_q8_q8_d64>:
\ts_load_b128 s[0:3], s[0:1], 0x0                            // 000000001000: F4004000
\tv_mov_b32_e32 v1, 0                                        // 000000001008: 7E020280
\tglobal_load_b32 v2, v[4:5], off                            // 00000000100C: EE000000
\tv_fmac_f32_e32 v1, v2, v3                                  // 000000001014: 56020702
\ts_cbranch_scc1 65533                                       // 000000001018: BFA2FFFD <hipkv_probe_q8_q8_d64+0xc>
\ts_cbranch_execz 1                                          // 00000000101C: BFA50001 <hipkv_probe_q8_q8_d64+0x24>
\tglobal_store_b32 v[4:5], v1, off                           // 000000001020: EE000000
\ts_endpgm                                                   // 000000001024: BFB00000
\ts_code_end                                                 // 000000001028: BF9F0000
";

    #[test]
    fn the_token_loop_counts_once_per_token_and_padding_not_at_all() {
        let f = functions(PROBE);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].name, "hipkv_probe_q8_q8_d64");
        let block = block_census(&f[0], 1).unwrap();
        let c = block.executed;
        let t = BLOCK_TOKENS;
        // s_load, v_mov, the loop (load, fma, branch) per token, execz, store, endpgm.
        assert_eq!(c.instructions, 2 + 3 * t + 3);
        assert_eq!((c.vmem_load, c.fma, c.vmem_store), (t, t, 1));
        assert_eq!((c.smem, c.salu), (1, t + 2));
        let one = block.token_loop;
        assert_eq!((one.instructions, one.vmem_load, one.fma), (3, 1, 1));
        // Two tokens per trip: the loop runs half as often; a trip is the same.
        let two = block_census(&f[0], 2).unwrap();
        assert_eq!(two.executed.instructions, 2 + 3 * t / 2 + 3);
        assert_eq!((two.token_loop, two.trip_tokens), (one, 2));
    }

    #[test]
    fn a_probe_of_another_shape_is_an_error() {
        let straight = PROBE.replace("65533 ", "0 ").replace("+0xc>", "+0x1c>");
        let f = functions(&straight);
        let e = block_census(&f[0], 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "hipkv_probe_q8_q8_d64: 0 loops where the issue model expects exactly one (the \
             token loop of the values)"
        );
        let uniform = PROBE.replace("s_cbranch_execz 1 ", "s_cbranch_vccz 1  ");
        let e = block_census(&functions(&uniform)[0], 1).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("hipkv_probe_q8_q8_d64: a branch at 0x101c decides on a wave-uniform"),
            "{e}"
        );
        let nowhere = PROBE.replace("+0xc>", "+0xe>");
        let e = block_census(&functions(&nowhere)[0], 1).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("targets 0x100e, which no instruction starts at"),
            "{e}"
        );
    }

    #[test]
    fn a_loop_entered_in_its_middle_has_the_entry_for_header() {
        // Rotated loops: the entry jumps to the test at 0x8, whose back edge goes to 0x4.
        let rotated = "
0000000000002000 <f>:
\ts_branch 1                                                 // 000000002000: BFA00001 <f+0x8>
\tv_add_f32_e32 v1, v1, v1                                   // 000000002004: 06020301
\ts_cbranch_scc1 65534                                       // 000000002008: BFA2FFFE <f+0x4>
\ts_endpgm                                                   // 00000000200C: BFB00000
";
        let f = functions(rotated);
        let graph = Graph::of(&f[0]).unwrap();
        let loops = graph.loops();
        let headers: Vec<usize> = loops.keys().copied().collect();
        assert_eq!(headers.len(), 1, "{headers:?}");
        assert_eq!(graph.blocks[headers[0]].start, 2, "the test is the header");
    }

    #[test]
    fn the_bound_is_the_longer_of_issue_and_memory() {
        // 128 SIMDs × 2.4 GHz issue 3.072e11 instructions/s; 640 GB/s reads 640 bytes in 1 ns.
        let card = RX_9070_XT;
        let memory_bound = predict(&card, 153.6, 1, 640.0, 1.0);
        assert!((memory_bound.issue_per_memory - 0.5).abs() < 1e-9);
        assert_eq!(memory_bound.fraction_of_peak, 1.0);
        let issue_bound = predict(&card, 153.6, 4, 640.0, 1.0);
        assert!((issue_bound.issue_per_memory - 2.0).abs() < 1e-9);
        assert!((issue_bound.fraction_of_peak - 0.5).abs() < 1e-9);
        // Fetching twice the bytes halves the fraction when memory bounds it.
        let twice = predict(&card, 153.6, 1, 640.0, 2.0);
        assert!((twice.fraction_of_peak - 0.5).abs() < 1e-9);
        assert_eq!((waves(8, 128), waves(4, 64), waves(1, 256)), (2, 1, 1));
    }
}
