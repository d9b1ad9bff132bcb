"""Plant known bugs one at a time and check that the tiny-model tests catch each (on demand; not
part of the suite CI runs).

    python tests/mutants.py [--only ID,ID] [--out docs/mutants.md]

Each mutant replaces one snippet of the package (it must occur exactly once) in a scratch copy of
``src/``, then runs the listed test files with that copy first on the path (``-x``: it stops at the
first failure, which is the test named in the table). A mutant no test fails "survives" and the
script exits non-zero. Real-model tests are deselected (``-m "not bundled"``): a bug must be
caught on the tiny models.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = ["tests/test_sampling.py", "tests/test_distribution.py"]
ENGINE = ["tests/test_engine.py"]

# (id, file under src/forerun, old snippet, new snippet, what it breaks, test files to run)
MUTANTS = [
    ("all-greedy", "verify.py", "p = logits_to_probs(logits, params)[None]",
     "p = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()[None]",
     "every sampled token made the target's argmax", SAMPLING),
    ("p-without-settings", "verify.py", "p = logits_to_probs(logits, params)[None]",
     "p = logits_to_probs(logits, type(params)(temperature=1.0))[None]",
     "temperature, top-k and top-p applied to q only, not to the target's p", SAMPLING),
    ("draft-q-first-only", "drafters/draft_model.py", "q=torch.stack(self.qs) if self.qs else None",
     "q=torch.stack([self.qs[0]] * len(self.qs)) if self.qs else None",
     "the draft model's q at positions >= 1 replaced by its q at position 0", SAMPLING),
    ("bonus-from-residual", "sampling.py", "q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)",
     "q_pad = torch.cat([q, q[:, -1:]], dim=1)",
     "the bonus token drawn from a residual at the last position instead of p", SAMPLING),
    ("accept-q-over-p", "sampling.py", "accept = u * q_safe <= p_d", "accept = u * p_d <= q_safe",
     "acceptance with probability q/p instead of p/q", SAMPLING),
    ("recover-from-p", "sampling.py", "residual = (p_next - q_next).clamp_min(0)", "residual = p_next.clone()",
     "the token after a rejection drawn from p instead of norm(max(0, p - q))", SAMPLING),
    ("fixed-uniform", "sampling.py", "u = torch.rand(batch, k, generator=generator, device=device)",
     "u = torch.full((batch, k), 0.5, device=device)", "acceptance decided by a constant instead of a uniform draw",
     SAMPLING),
    ("hf-crop-stale", "backends/hf.py", "self._cache.crop(-(self._len - length))",
     "self._cache.crop(-(self._len - length) + 1)", "HFBackend's rollback keeps one stale position",
     ["tests/test_native.py"]),
    ("drop-own-token", "decode.py", "new = out[: n_acc + 1]", "new = out[: max(n_acc, 1)]",
     "a step commits its accepted drafts but drops the target's own token", ENGINE),
    ("ngram-shift", "drafters/ngram.py", "follow = tokens[start + n : start + n + k]",
     "follow = tokens[start + n + 1 : start + n + k + 1]", "n-gram proposals shifted by one token", ENGINE),
    ("greedy-not-prefix", "sampling.py", "n = match.cumprod(-1).sum(-1)  # accepted prefix length",
     "n = match.sum(-1)", "greedy acceptance counts matches after the first mismatch", ENGINE),
    ("tree-no-compaction", "decode.py", "s.backend.keep_rows(root, v.rows[:n_acc])", "pass",
     "after a tree pass the accepted path's cache rows are not moved into place",
     ["tests/test_tree.py", "tests/test_suffix.py"]),
    ("batch-accept-none", "verify.py",
     "return [judge(c.draft, out, c.params, c.generator, c.root, c.masks) for c, out in zip(checks, outs)]",
     "return [__import__('dataclasses').replace(judge(c.draft, out, c.params, c.generator, c.root, c.masks), accepted=0) "
     "for c, out in zip(checks, outs)]",
     "the batch engine throws away every accepted draft (lossless, but speculation does nothing)",
     ["tests/test_batching.py"]),
    ("argmax-last-tie", "backends/qrows.c", "return v > best || (v != v && best == best);",
     "return v >= best || (v != v && best == best);",
     "the integer path's greedy head keeps the last of equal maxima, not the first (torch.argmax's)",
     ["tests/test_qrows.py"]),
    ("argmax-filter-inverted", "backends/qrows.c", "if (ri[k - 1] >= 0 && !chunk_may_beat(",
     "if (ri[k - 1] >= 0 && chunk_may_beat(",
     "the greedy head's filter skips the buffers that can hold a new maximum",
     ["tests/test_qrows.py"]),
    ("top2-runner-up-stuck", "backends/qrows.c", "} else if (k == 2 && (bi[1] < 0 || beats(v, b[1]))) {",
     "} else if (k == 2 && bi[1] < 0) {",
     "the LM head's runner-up is the first value below the maximum, not the second largest",
     ["tests/test_qrows.py"]),
    ("bytes-without-bias", "backends/qtile.h", "if (zb && !off && f16 == FACTORED) GT(U8, 2, 2, 1, 0, FACTORED);",
     "if (zb && !off && f16 == FACTORED) GT(U8, 2, 2, 0, 0, FACTORED);",
     "a Q6_K weight read as bytes by passes of several rows loses its code bias (-32)",
     ["tests/test_qrows.py"]),
    ("head-scales-not-half", "backends/qact.c", "float d = half_to_float(float_to_half(a->dx[i]));",
     "float d = a->dx[i];",
     "the certified head's activation scales stay float32 where ggml's Q8_0 rounds them to fp16",
     ["tests/test_native.py"]),
    ("attn-block-restart", "backends/attend_kv.h", "s[u] = _mm256_loadu_ps(ar + d0 + 8 * u);",
     "s[u] = _mm256_setzero_ps();",
     "attention over a pass's rows restarts each row's value sums at every block of keys",
     ["tests/test_native.py"]),
    ("attn-rows-no-extras", "backends/attend_kv.h",
     "for (int e = 0; e < n_extra[r]; e++) KVN(add_scaled)(ar, wr[nr + e], vh + (int64_t)extra[r][e] * D, D);",
     ";", "attention over a pass's rows leaves tree rows' extra slots out of their value sums",
     ["tests/test_native.py"]),
    ("tree-room-plus-one", "decode.py", "if d.parents is not None and len(d) > room:",
     "if d.parents is not None and len(d) > room + 1:",
     "a token tree cut to the room before the context limit only when it exceeds it by two nodes",
     ["tests/test_tree.py"]),
    ("batch-global-rng", "verify.py", "judge(c.draft, out, c.params, c.generator, c.root, c.masks)",
     "judge(c.draft, out, c.params, None, c.root, c.masks)",
     "a batched pass samples with the global generator instead of each request's seeded one",
     ["tests/test_batching.py"]),
    ("noise-follows-draft", "verify.py", "[root + 1 + d for d in depth]", "[root + 1 + d + len(draft) for d in depth]",
     "a seeded sequence's noise depends on how much was drafted, not on the position alone",
     ["tests/test_seeded.py"]),
    ("noise-shared-stream", "sampling.py", "e = self._noise.get(key)",
     "self._calls = getattr(self, '_calls', 0) + 1; e = None; position = self._calls",
     "a seeded sequence's noise drawn from one stream advanced at every draw (drafting's draws too), "
     "not keyed by position", ["tests/test_seeded.py"]),
    ("p-without-temperature", "verify.py", "p = logits_to_probs(logits, params)[None]",
     "p = logits_to_probs(logits, type(params)(**{**params.__dict__, 'temperature': 1.0}))[None]",
     "the target's p taken at temperature 1 (top-k and top-p kept)", SAMPLING),
    ("fixed-span-of-chunk", "backends/fixed_rows.py",
     "groups.setdefault((seq, key_span(pos_j, limit), None if path is None else j), []).append(j)",
     "groups.setdefault((seq, key_span(rows[-1][0], limit), None if path is None else j), []).append(j)",
     "fixed-shape passes: every row of a chunk attends over the last row's key span, not its own",
     ["tests/test_fixed_rows.py"]),
    ("fixed-tree-in-cache-order", "backends/fixed_rows.py",
     "kk, vk = self._gathered(seq, kc, vc, rows[tree_row], span)", "kk, vk = kc[:, :span], vc[:, :span]",
     "fixed-shape passes: a tree row reads the cache in slot order, not laid out as its path",
     ["tests/test_fixed_rows.py"]),
    ("fixed-tree-exact-head", "backends/greedy_targets.py", "return self.model.fixed is not None", "return False",
     "fixed-shape passes: greedy tree rows decided by the exact head (the lazy walk), steps by the chunk logits",
     ["tests/test_fixed_rows.py"]),
    ("fixed-big-tree-library", "backends/fixed_rows.py", "return tree is not None or rows <= MAX_ROWS",
     "return rows <= MAX_ROWS", "fixed-shape passes: a tree over 64 rows leaves the fixed chunks for the library's kernels",
     ["tests/test_fixed_rows.py"]),
    ("fixed-f16-stale-inf", "backends/fixed_rows.py", "sanitize = model.dtype == torch.float16", "sanitize = False",
     "fixed-shape passes: a float16 value that overflowed stays Inf in the cache (0 x Inf = NaN when masked)",
     ["tests/test_fixed_rows.py"]),
    ("draft-window-noise-position", "drafters/draft_model.py", "position=self.pos + self.offset)",
     "position=self.pos)",
     "a windowed draft model draws its seeded tokens with its cache position's noise, not the sequence's",
     ["tests/test_seeded.py"]),
    # 2026-11-28: the code added since the list was written, and the six a mutation run left alive
    ("noise-clamp-dropped", "sampling.py", "e = self._noise[key] = torch.log1p(-u).neg_().clamp_(min=2.0 ** -30)",
     "e = self._noise[key] = torch.log1p(-u).neg_()",
     "seeded noise E = 0 where the uniform draw is 0: a token of probability 0 can win", ["tests/test_seeded.py"]),
    ("head-noise-next-position", "drafters/eagle.py", "tok, q = self._pick(head.logits(hid[-1]), len(tokens) + d)",
     "tok, q = self._pick(head.logits(hid[-1]), len(tokens) + d + 1)",
     "an EAGLE head draws each seeded draft with the next position's noise", ["tests/test_heads.py"]),
    ("keep-on-any-path", "batching.py", "self.prefix_cache is not None and self.target.capabilities.kv_any_pass and",
     "self.prefix_cache is not None and True and",
     "the target keeps a finished answer's chunks where a pass of many rows is not computed row by row",
     ["tests/test_prefix_cache.py"]),
    ("keep-shifted-chunk", "prefix_cache.py", "cache.put(key, backend.kv_segment(s, e))",
     "cache.put(key, backend.kv_segment(max(0, s - 1), max(0, s - 1) + e - s))",
     "a finished sequence's chunk kept with the keys and values of the positions one before it",
     ["tests/test_prefix_cache.py"]),
    ("batch-rows-limit-whole-pass", "backends/runners.py", "    if len(parts) > 1 and model.batch_invariant:\n        how = ROWS_ANY",
     "    if False:\n        how = ROWS_ANY",
     "a batched pass of more than 64 rows takes the library kernels: a row's bits depend on the batch",
     ["tests/test_native.py"]),
    ("head-logits-by-row-count", "backends/native_model.py",
     'how = (ROWS_ANY if batched else "rows") if self.batch_invariant else None', "how = None",
     "the LM head's logits from the kernel timed fastest per row count: a row's logits depend on the pass",
     ["tests/test_native.py"]),
    ("q8-certificate-no-margin", "backends/greedy_head.py", "(best[:, 1] < m - 2 * eps)", "(best[:, 1] < m)",
     "the llama.cpp certificate without its rounding margin certifies exact ties", ["tests/test_native.py"]),
    ("q8-bound-block-totals", "backends/greedy_head.py", "bound = (self.nb + 6) * _U32 * (scale.abs() * asum).sum(-1) * 1.01",
     "bound = (self.nb + 6) * _U32 * (scale * isum).abs().sum(-1) * 1.01",
     "the certificate's fallback bound from the blocks' totals, not llama.cpp's lanes", ["tests/test_native.py"]),
    ("narrow-in-weight-type", "backends/greedy_head.py", "logits = (self.weight[cand].float() @ h).cpu()",
     "logits = (self.weight[cand] @ h.to(self.weight.dtype)).float().cpu()",
     "a half-precision head narrowed with products in its own type against float32's error bound",
     ["tests/test_native.py"]),
    ("exact-head-no-activation-term", "backends/greedy_head.py",
     "bound = (self.w_norm * (hs - hqs).norm(dim=-1) + self.err_norm * hq_norm",
     "bound = (self.err_norm * hq_norm",
     "the screened exact head's bound without the activation-rounding term", ["tests/test_native.py"]),
    ("tree-residual-keeps-rejected", "tree.py", "            resid[t] = 0.0", "            pass",
     "a sampled tree's rejected candidate stays in the residual its siblings and the last token draw from",
     ["tests/test_tree.py"]),
    ("tree-accept-unnormalised", "tree.py", "if u * mass < float(resid[t]):", "if u < float(resid[t]):",
     "a tree child accepted with its residual probability, not the residual renormalised",
     ["tests/test_distribution_power.py"]),
    ("tree-p-at-temperature-1", "verify.py",
     "sample_tree_accept(draft.tokens, draft.parents, logits_to_probs(out.logits, params), generator)",
     "sample_tree_accept(draft.tokens, draft.parents, torch.softmax(out.logits.float(), -1), generator)",
     "a sampled tree judged with p at temperature 1 without top-k or top-p", ["tests/test_distribution_power.py"]),
    ("submit-takes-zero-tokens", "decode.py", "or max_new_tokens < 1:", "or max_new_tokens < 0:",
     "a request for no new tokens is taken (and commits one)", ["tests/test_batching.py"]),
    ("server-top-p-unbounded", "server/requests.py", "not 0 < top_p <= 1", "not 0 < top_p",
     "top_p above 1 reaches the sampler (a 500, not a 400)", ["tests/test_server.py"]),
    ("probe-draft-cut-to-nothing", "draft_length.py", "        return self._cut(conf, 1 if self._probed else 0)",
     "        return self._cut(conf, 0)",
     "a draft model's probe cut to nothing on stale costs, so nothing measures them again",
     ["tests/test_draft_length.py"]),
    ("slow-spell-fast-sample-weighs-a-fifth", "draft_length.py", "return ema(old, max(new, 0.5 * old), 0.5)",
     "return ema(old, max(new, 0.5 * old))",
     "a measured cost left high by a slow spell comes down a fifth of the way per sample",
     ["tests/test_draft_length.py"]),
    ("probe-drafting-time-ignored", "draft_length.py", "if tokens and (apart or not self._probed):",
     "if tokens and not self._probed:",
     "a draft model's probe is not a sample of a draft token's cost (its reading is timed apart)",
     ["tests/test_draft_length.py"]),
    ("grammar-cuts-sampled-drafts", "decode.py", "sampled_q = d.q is not None and not s.params.greedy",
     "sampled_q = False and not s.params.greedy",
     "a draft drawn from q cut before the token the grammar forbids (the target then samples p there)",
     ["tests/test_constrain.py"]),
    ("grammar-mask-first-row-only", "verify.py", "keep[..., :width] = masks[: logits.shape[0], :width].to(logits.device)",
     "keep[..., :width] = masks[:1, :width].to(logits.device)",
     "every row of a constrained pass masked as the first", ["tests/test_constrain.py"]),
    ("grammar-tree-no-reroot", "constrain.py", "            for n in want[common:]:  # then down to the parent",
     "            for n in want[len(want):]:  # then down to the parent",
     "a tree node's mask taken in its last sibling's state", ["tests/test_constrain.py"]),
    ("draft-keeps-past-shared", "drafters/draft_model.py", "n = min(common_prefix(held, prompt), self.backend.length,",
     "n = min(common_prefix(held, prompt) + 1, self.backend.length,",
     "a draft model's next sequence keeps one position past the tokens it shares with the last", ENGINE),
    ("draft-keeps-unsettled", "drafters/draft_model.py",
     "        self._settled = False  # drafts go into the cache until the verdict (``accepted``) cuts them",
     "        self._settled = True", "a draft model keeps positions after a sequence that ended with drafts in its cache",
     ENGINE),
]


def run_one(mid, rel, old, new, tests, scratch: Path) -> tuple[str, str]:
    src = scratch / "src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    path = src / "forerun" / rel
    text = path.read_text()
    if text.count(old) != 1:
        return "not planted", f"the snippet occurs {text.count(old)} times in {rel}"
    path.write_text(text.replace(old, new))
    env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["FORERUN_CACHE"] = str(scratch / "cache")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not bundled", *tests]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    failed = re.search(r"^FAILED (\S+)", out, re.M) or re.search(r"^ERROR (\S+)", out, re.M)
    if proc.returncode == 0:
        return "survived", ""
    if failed:
        return "killed", failed.group(1).split(" - ")[0]
    return "error", out.strip().splitlines()[-1] if out.strip() else f"exit {proc.returncode}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated mutant ids")
    ap.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if args.only is None or m[0] in args.only.split(",")]
    unknown = set(args.only.split(",")) - {m[0] for m in MUTANTS} if args.only else set()
    if unknown:
        print(f"unknown mutant ids: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="forerun-mutants-") as tmp:
        for mid, rel, old, new, what, tests in chosen:
            status, where = run_one(mid, rel, old, new, tests, Path(tmp))
            rows.append((mid, rel, what, status, where))
            print(f"{mid:22s} {status:10s} {where}", flush=True)
    lines = [f"Mutation run of {datetime.date.today().isoformat()} (`python tests/mutants.py`):", "",
             "| planted bug | file | status | first test that failed |", "|---|---|---|---|"]
    lines += [f"| {what} (`{mid}`) | `{rel}` | {status} | `{where}` |" for mid, rel, what, status, where in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0 if all(r[3] == "killed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
