"""A user's own configuration (``--fix tp=8,pp=8,mbs=1,recompute=full,schedule=1f1b``):
parsed into restrictions of the executable space, and compared with the free plan."""
from __future__ import annotations

from ..spec import SpecError

RECOMPUTE = {"auto": "dp", "none": "none", "full": "full", "selective": "selective"}
SP = {"on": "on", "off": "off", "auto": "auto", "true": "on", "false": "off", "1": "on", "0": "off"}
INT_KEYS = {"tp", "pp", "dp", "mbs", "zero", "v", "ep", "etp", "cp"}
KEYS = INT_KEYS | {"schedule", "recompute", "sp", "cp_comm", "offload"}
ALIASES = {"micro_batch_size": "mbs", "micro-batch": "mbs", "zero_stage": "zero", "chunks": "v",
           "sequence_parallel": "sp", "cp-comm": "cp_comm", "cp_comm_type": "cp_comm"}
CP_COMM = ("p2p", "a2a")


def parse_fix(text: str | dict | None, option: str = "--fix") -> dict:
    """``'tp=8,pp=8,mbs=1,zero=1,schedule=interleaved,v=3,recompute=full,sp=on'`` -> dict;
    also ``ep`` (expert parallelism), ``etp`` (expert TP), ``cp`` (context parallelism) and
    ``cp_comm`` (p2p: ring attention; a2a: Ulysses) and ``offload`` (spec.parallel.Offload's text:
    none, opt, opt:0.5, opt+param, nvme:opt+param).
    recompute: auto (the planner's per-stage choice), none, full (every block, even split into
    the schedule's stages, as Megatron's --recompute-granularity full), selective (the attention core of every
    layer, Megatron's --recompute-granularity selective).  ``option``: the command-line option
    the text came from, named in refusals (``ds-autoplan cost`` takes it as --config).  A key
    given twice, or a text naming nothing, is refused."""
    if text is None or isinstance(text, dict) and not text:
        return {}
    if isinstance(text, str) and not text.replace(",", "").strip():
        raise SpecError(f"{option}: names nothing; give key=value pairs, e.g. tp=2,pp=2")
    items = text.items() if isinstance(text, dict) else \
        (kv.split("=", 1) if "=" in kv else (kv, None) for kv in str(text).split(",") if kv.strip())
    out = {}
    for k, v in items:
        k = ALIASES.get(k.strip().lower(), k.strip().lower())
        if k not in KEYS or v is None or str(v).strip() == "":
            raise SpecError(f"{option}: expected key=value with key in {', '.join(sorted(KEYS))}; got {k!r}")
        if k in out:
            raise SpecError(f"{option}: {k} is given twice")
        v = str(v).strip().lower()
        if k in INT_KEYS:
            if not v.isdigit() or int(v) < (0 if k == "zero" else 1):
                raise SpecError(f"{option}: {k} must be a {'non-negative' if k == 'zero' else 'positive'} "
                                f"integer, got {v!r}")
            out[k] = int(v)
        elif k == "recompute":
            if v not in RECOMPUTE:
                raise SpecError(f"{option}: recompute must be one of {', '.join(RECOMPUTE)}, got {v!r}")
            out[k] = v
        elif k == "cp_comm":
            if v not in CP_COMM:
                raise SpecError(f"{option}: cp_comm must be p2p (ring attention) or a2a (Ulysses), got {v!r}")
            out[k] = v
        elif k == "offload":
            from ..spec.parallel import Offload
            try:
                out[k] = Offload.parse(v).text()
            except SpecError as e:
                raise SpecError(f"{option}: {e}") from None
        elif k == "sp":
            if v not in SP:
                raise SpecError(f"{option}: sp must be on, off or auto, got {v!r}")
            out[k] = SP[v]
        else:
            out[k] = v
    if "v" in out and not _takes_chunks(out.get("schedule")):
        raise SpecError(f"{option}: v (chunks per rank) needs a schedule that takes it as an option "
                        "(schedule=interleaved)")
    return out


def fix_text(fix: dict) -> str:
    """A parsed configuration as the user writes it: ``tp=8,pp=2``."""
    return ",".join(f"{k}={v}" for k, v in fix.items())


def _takes_chunks(schedule: str | None) -> bool:
    """The builder registry says ``schedule`` sets its chunks per rank by an option."""
    from ..schedule import ScheduleError
    from .pipeline import schedule_options
    try:
        return schedule is not None and bool(schedule_options(schedule))
    except ScheduleError:
        return False


def describe(s: dict) -> str:
    """One line for a plan summary (``Candidate.summary``)."""
    v = f" v={s['chunks']}" if s.get("chunks", 1) > 1 else ""
    if s.get("ep", 1) > 1:
        v += f" ep={s['ep']}" + (f" etp={s['etp']}" if s["etp"] != s["tp"] else "")
    if s.get("cp", 1) > 1:
        v += f" cp={s['cp']} ({'ring' if s['cp_comm'] == 'p2p' else 'Ulysses'})"
    if s.get("offload", "none") != "none":
        from ..spec.parallel import Offload
        v += f", offload: {Offload.parse(s['offload']).label()}"
    return (f"pp={s['pp']} tp={s['tp']}{'+sp' if s['sequence_parallel'] else ''} dp={s['dp']} "
            f"ZeRO-{s['zero_stage']} {s['schedule']}{v} micro-batch {s['micro_batch_size']} x "
            f"{s['num_microbatches']}, recompute "
            + ("attention (selective)" if s.get("selective_recompute") else f"{sum(s['recompute_layers'])} blocks"))


def reasons(mine: dict, best: dict) -> list[str]:
    """Why ``best`` is faster than ``mine``: the figures that differ, largest effect first."""
    out = []
    if best["bubble"] + 1e-3 < mine["bubble"]:
        out.append(f"pipeline bubble {best['bubble']:.1%} instead of {mine['bubble']:.1%}")
    rb, rm = sum(best["recompute_layers"]), sum(mine["recompute_layers"])
    if rb < rm:
        out.append(f"recomputes {rb} blocks instead of {rm}")
    if best["tp"] < mine["tp"]:
        out.append(f"tensor parallel {best['tp']} instead of {mine['tp']} (less all-reduce per layer)")
    if best["micro_batch_size"] > mine["micro_batch_size"]:
        out.append(f"micro-batch {best['micro_batch_size']} instead of {mine['micro_batch_size']} "
                   f"(fewer, larger steps)")
    for k, what, why in (("ep", "expert parallel", "less token all-to-all"),
                         ("cp", "context parallel", "fewer KV exchanges")):
        if best.get(k, 1) < mine.get(k, 1):
            out.append(f"{what} {best[k]} instead of {mine[k]} ({why})")
    from ..spec.parallel import Offload
    ob, om = Offload.parse(best.get("offload")), Offload.parse(mine.get("offload"))
    if (ob.optimizer, ob.params, ob.device) < (om.optimizer, om.params, om.device):
        out.append(f"{ob.label()} instead of {om.label()} (less host traffic and CPU step time)")
    if best["zero_stage"] < mine["zero_stage"]:
        out.append(f"ZeRO-{best['zero_stage']} instead of ZeRO-{mine['zero_stage']} (less gradient traffic)")
    return out or ["a better balance of stages and communication on the same cost model"]
