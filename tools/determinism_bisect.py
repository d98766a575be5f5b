"""Where do two same-seed training runs of train_example part? (device bisect; runs on a CPU too)

Builds two copies of the model from the same seed and trains them in lockstep on the same batches
(train_example's recipe: BF16 autocast, fp32 master weights, AdamW, clipping). After each step it
compares, bit for bit, the loss, every module's forward output (forward order), every module's
output gradient (the order backward produced them), every parameter gradient and every updated
parameter, and names the first that differs: an output gradient that differs while the one
produced just before it agrees points at the backward of the module between them (e.g.
``blocks.7.attn.qkv`` differing after ``blocks.7.attn.proj`` agreed: attention's backward).

    python tools/determinism_bisect.py --device cuda --preset gpu --mode warn-only  # the old one
    python tools/determinism_bisect.py --device cuda --preset gpu --mode strict --sdpa math
    python tools/determinism_bisect.py ... --dump a.json   # then, in another process:
    python tools/determinism_bisect.py ... --against a.json  # per-step hashes across processes
    python tools/determinism_bisect.py ... --time-modes off,warn-only,strict  # cost of the fix

``--mode``: ``strict`` (train_example's ``--deterministic``), ``warn-only`` (PyTorch's
deterministic algorithms with ``warn_only=True``: what ``--deterministic`` was before) or
``off``. ``--sdpa``: the attention backend (``default`` lets PyTorch choose). Exit code 0 when
every compared step agreed, 1 when something differed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a checkout without `pip install`
    sys.path.insert(0, str(ROOT))

from train_example import data as D  # noqa: E402
from train_example import train as T  # noqa: E402
from train_example.model import MoETransformer, lm_loss, model_config  # noqa: E402

MODES = ("strict", "warn-only", "off")
SDPA = ("default", "math", "flash", "efficient", "cudnn")


def set_mode(mode: str) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    if mode == "strict":
        T.set_deterministic()
    else:
        torch.use_deterministic_algorithms(mode == "warn-only", warn_only=True)


def sdpa_context(name: str):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


class Recorder:
    """Forward hooks on every module: its output (forward order) and the gradient of that output
    (in the order backward produces them)."""

    def __init__(self, model: torch.nn.Module):
        self.acts: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}  # insertion order = backward order
        for name, mod in model.named_modules():
            if name:
                mod.register_forward_hook(self._hook(name))

    def clear(self) -> None:
        self.acts.clear()
        self.grads.clear()

    def _hook(self, name: str):
        def hook(mod, inp, out):
            if not isinstance(out, torch.Tensor):
                return
            self.acts[name] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g: self.grads.__setitem__(name, g.detach().clone()))
        return hook


def build(args, device):
    torch.manual_seed(args.seed)
    tc = T.TRAIN_PRESETS[args.preset]
    mc = model_config(args.preset, max_seq_len=max(args.seq_len, model_config(args.preset)
                                                   .max_seq_len))
    backend = args.backend or T.default_backend(device)
    model = MoETransformer(mc, precision=args.precision, backend=backend,
                           scale_blocks=args.scale_blocks).to(device)
    opt = torch.optim.AdamW(T._param_groups(model, tc.weight_decay), lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), eps=1e-8)
    return model, opt


def train_step(model, opt, text, step, args, device, tc) -> tuple[torch.Tensor, torch.Tensor]:
    """One train_example step (0-based ``step``), gradients kept: returns (loss, aux). The
    optimizer steps in `finish_step`."""
    for g in opt.param_groups:
        g["lr"] = T.lr_at(step, tc)
    x, y = D.train_batch(text, step, args.batch_size, args.seq_len, args.seed)
    x, y = x.to(device), y.to(device)
    with sdpa_context(args.sdpa), torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(x)
    loss = lm_loss(logits, y)
    aux = model.aux_loss
    (loss + aux).backward()
    return loss.detach(), aux.detach()


def finish_step(model, opt, tc) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def first_diff(a: dict, b: dict) -> tuple[str | None, str | None]:
    """The first key (in ``a``'s order) whose tensors differ, and the key before it."""
    prev = None
    for k, t in a.items():
        u = b.get(k)
        if u is None or u.shape != t.shape or not torch.equal(t, u):
            return k, prev
        prev = k
    return None, prev


def describe(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a.float() - b.float()).abs()
    return (f"{int((a != b).sum())} of {a.numel()} elements differ, max |diff| "
            f"{d.max().item():.3e} (max |value| {a.float().abs().max().item():.3e})")


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def compare_step(step, la, lb, ra, rb, ma, mb) -> list[str]:
    """Report lines for one step; empty when everything agreed."""
    out = []
    if not torch.equal(la[0], lb[0]) or not torch.equal(la[1], lb[1]):
        out.append(f"  loss {la[0].item()!r} vs {lb[0].item()!r}, aux {la[1].item()!r} vs "
                   f"{lb[1].item()!r}")
    name, prev = first_diff(ra.acts, rb.acts)
    if name is not None:
        what = describe(ra.acts[name], rb.acts[name])
        out.append(f"  first forward output that differs: {name} ({what}); the one before it "
                   f"agreed: {prev}")
    name, prev = first_diff(ra.grads, rb.grads)
    if name is not None:
        out.append(f"  first output gradient (backward order) that differs: {name} "
                   f"({describe(ra.grads[name], rb.grads[name])}); produced after {prev}'s, "
                   f"which agreed: look at the backward of what consumes {name}'s output")
    pa = dict(ma.named_parameters())
    pb = dict(mb.named_parameters())
    bad = [n for n, p in pa.items()
           if (p.grad is None) != (pb[n].grad is None)
           or (p.grad is not None and not torch.equal(p.grad, pb[n].grad))]
    if bad:
        what = describe(pa[bad[-1]].grad, pb[bad[-1]].grad)
        out.append(f"  parameter gradients that differ: {len(bad)} of {len(pa)}; last in model "
                   f"order (first in backward): {bad[-1]} ({what})")
        by_module = sorted({n.rsplit('.', 1)[0] for n in bad})
        out.append(f"  modules: {', '.join(by_module[:12])}{' ...' if len(by_module) > 12 else ''}")
    return out


def step_record(step, loss, model) -> dict:
    return {"step": step, "loss": loss[0].float().item().hex(), "aux": loss[1].float().item().hex(),
            "grads": {n: digest(p.grad) for n, p in model.named_parameters() if p.grad is not None}}


def time_modes(model, opt, text, args, device, tc, modes) -> None:
    for mode in modes:
        set_mode(mode)
        for s in range(2):  # warm-up (compiles, allocator)
            train_step(model, opt, text, s, args, device, tc)
            finish_step(model, opt, tc)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for s in range(args.time_steps):
            train_step(model, opt, text, s, args, device, tc)
            finish_step(model, opt, tc)
        sync()
        ms = 1e3 * (time.perf_counter() - t0) / args.time_steps
        print(f"timing: mode {mode:9s} sdpa {args.sdpa}: {ms:.1f} ms/step "
              f"({args.time_steps} steps)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", choices=sorted(T.TRAIN_PRESETS), default="gpu")
    p.add_argument("--precision", choices=("bf16", "mxfp8"), default="bf16")
    p.add_argument("--scale-blocks", default="auto")
    p.add_argument("--backend", default=None)
    p.add_argument("--mode", choices=MODES, default="strict")
    p.add_argument("--sdpa", choices=SDPA, default="default")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--all-steps", action="store_true", help="go on after a step that differed")
    p.add_argument("--dump", default=None, help="write run A's per-step loss and gradient hashes")
    p.add_argument("--against", default=None, help="compare run A with another process's --dump")
    p.add_argument("--time-modes", default="", help="e.g. off,warn-only,strict: ms/step of each")
    p.add_argument("--time-steps", type=int, default=10)
    args = p.parse_args(argv)
    tc = T.TRAIN_PRESETS[args.preset]
    args.batch_size = args.batch_size or tc.batch_size
    args.seq_len = args.seq_len or tc.seq_len
    device = torch.device(args.device)
    set_mode(args.mode)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {gpu}; "
          f"preset {args.preset} batch {args.batch_size}x{args.seq_len}, {args.precision} "
          f"(scale_blocks {args.scale_blocks}), mode {args.mode}, sdpa {args.sdpa}", flush=True)
    text = D.load_stdlib_text(args.seed, tc.max_train_bytes, tc.max_val_bytes)
    ma, oa = build(args, device)
    mb, ob = build(args, device)
    ra, rb = Recorder(ma), Recorder(mb)
    records, differed = [], False
    for step in range(args.steps):
        ra.clear()
        rb.clear()
        la = train_step(ma, oa, text, step, args, device, tc)
        lb = train_step(mb, ob, text, step, args, device, tc)
        lines = compare_step(step, la, lb, ra, rb, ma, mb)
        records.append(step_record(step, la, ma))
        finish_step(ma, oa, tc)
        finish_step(mb, ob, tc)
        if not lines:
            pa, pb = dict(ma.named_parameters()), dict(mb.named_parameters())
            bad = [n for n in pa if not torch.equal(pa[n], pb[n])]
            if bad:
                lines = [f"  updated parameters differ (optimizer): {bad[:5]}"]
        print(f"step {step + 1}: {'DIFFERS' if lines else 'identical'} "
              f"(loss {la[0].item():.6f})", flush=True)
        for line in lines:
            print(line, flush=True)
        differed |= bool(lines)
        if lines and not args.all_steps:
            break
    if args.dump:
        Path(args.dump).write_text(json.dumps(records, indent=1))
    if args.against:
        other = {r["step"]: r for r in json.loads(Path(args.against).read_text())}
        for r in records:
            o = other.get(r["step"])
            if o is None:
                continue
            bad = [n for n, h in r["grads"].items() if o["grads"].get(n) != h]
            same = r["loss"] == o["loss"] and r["aux"] == o["aux"] and not bad
            print(f"against {args.against}: step {r['step'] + 1} "
                  f"{'identical' if same else 'DIFFERS'}"
                  + (f" (loss {r['loss']} vs {o['loss']}; {len(bad)} gradients, last in model "
                     f"order {bad[-1] if bad else '-'})" if not same else ""), flush=True)
            differed |= not same
    del mb, ob, rb
    for mod in ma.modules():  # the timing runs without the recorder's hooks
        mod._forward_hooks.clear()
    modes = [m for m in args.time_modes.split(",") if m]
    if modes:
        time_modes(ma, oa, text, args, device, tc, modes)
    print("RESULT:", "runs DIFFER" if differed else "runs identical bit for bit", flush=True)
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
