"""Planning any module for DeepSpeed's own engine (no pipeline): the model's size and shape from
the module itself, its trained parameters from ``requires_grad``, the plan from the engine's
space (search/engine_space.py).  Used by ``deepspeed.initialize(model=<any nn.Module>)`` under
``--autoplan`` and by the Hugging Face ``Trainer`` / Accelerate hooks (clients/hf.py).

* A Hugging Face model (a ``config`` with a ``model_type``; peft's wrappers forward it) is
  planned from its config, the same families as ``--model config.json`` (spec/hf.py); a peft
  LoRA model's adapters are counted from its ``peft_config`` (r, target modules) and checked
  against the module's own trainable parameters.
* Any other module: its counted parameters, and one micro-batch of its training data profiled
  (profile/layers.py) for time and activations; without data, parameters only (said so).
"""
from __future__ import annotations

import copy
import json
import os

import torch

from ..errors import UserError


class AutoplanRefused(UserError):
    """ds_autoplan cannot plan what the script passed to ``deepspeed.initialize`` (or to a
    Trainer / Accelerate)."""


def user_config_of(args, config) -> dict:
    """The script's DeepSpeed config (``--deepspeed_config`` in ``args`` or ``config=``: a path
    or a dict), a copy."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    for name in ("deepspeed_config", "deepscale_config"):
        path = getattr(args, name, None)
        if path is not None:
            if config is not None:
                raise AutoplanRefused(f"the script gives both --{name} and config=")
            config = path
    return copy.deepcopy(load_ds_config(config)) if config is not None else {}


def hf_config(model) -> dict | None:
    """The Hugging Face config of ``model`` as a dict (None: not a Hugging Face model)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict") or not getattr(cfg, "model_type", None):
        return None
    return cfg.to_dict()


def counted(model) -> tuple[int, int]:
    """(parameters, trainable parameters) the module holds (shared tensors once)."""
    seen, total, train = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        train += p.numel() if p.requires_grad else 0
    return total, train


def trainable_of(model, spec=None):
    """The :class:`~ds_autoplan.spec.trainable.Trainable` of ``model``: LoRA from a peft
    model's config (its count checked against the module's), else the trained fraction."""
    from ..spec.trainable import FULL, LORA_TARGETS, Trainable
    total, train = counted(model)
    if train == 0:
        raise AutoplanRefused(f"{type(model).__name__} has no parameter with requires_grad: nothing to train")
    peft = getattr(model, "peft_config", None)
    if spec is not None and isinstance(peft, dict) and len(peft) == 1:
        c = next(iter(peft.values()))
        targets = tuple(sorted(getattr(c, "target_modules", None) or ()))
        if getattr(c, "peft_type", None) is not None and str(c.peft_type).endswith("LORA") and \
                targets and set(targets) <= set(LORA_TARGETS):
            t = Trainable(lora_r=int(c.r), lora_targets=targets)
            if int(t.counts(spec)[1]) == train:
                return t
    return FULL if train == total else Trainable(fraction=train / total)


def checkpointing_of(model) -> bool:
    """Whether the module offers all-layer activation checkpointing (Hugging Face's switch)."""
    return callable(getattr(model, "gradient_checkpointing_enable", None)) and \
        bool(getattr(model, "supports_gradient_checkpointing", True))


def model_spec(model, seq: int | None, sample=None, name: str = "module"):
    """The planner's ModelSpec of ``model``: from its Hugging Face config, else a profile of one
    micro-batch ``sample`` (the module's input), else its parameter count only."""
    from ..spec import SpecError
    from ..spec.model import LayerSpec, ModelSpec, load_model
    cfg = hf_config(model)
    if cfg is not None:
        try:
            return load_model({**cfg, "name": cfg.get("_name_or_path") or type(model).__name__}, seq)
        except SpecError as e:
            raise AutoplanRefused(f"planning {type(model).__name__}: {e}") from None
    if sample is not None:
        from ..profile import to_model_spec
        from ..profile.layers import profile_layer_list
        return to_model_spec(profile_layer_list([model], sample, name=name))
    n = float(counted(model)[0])
    none = LayerSpec("none", "pre", 0.0, 0.0, 0.0, 0.0, 0.0, 0, False)
    body = LayerSpec(type(model).__name__, "block", n, 2.0 * n, 0.0, 0.0, 0.0, 0, False)
    return ModelSpec(name=name, arch="gpt", seq_len=1, hidden=1, heads=1, num_layers=1, vocab=0,
                     layers=(body,), pre=none, post=none,
                     config={"name": name, "tie_embeddings": False,
                             "note": "parameters only: no training_data to measure activations"})


def autotp_of(model) -> bool:
    """Whether DeepSpeed's AutoTP can shard ``model``: a Hugging Face model (AutoTP finds its
    layers from the config) without peft adapters (their wrapped linear layers are not AutoTP's)."""
    return hf_config(model) is not None and getattr(model, "peft_config", None) is None


# the plan replaces the user's own setting only when predicted faster by more than this
# (a tie, or a gain inside the model's rounding, keeps theirs)
YOURS_MARGIN = 0.005


def plan_module(model, *, global_batch: int, world: int, precision: str, options: dict,
                seq: int | None = None, sample=None, fix: dict | None = None, autotp: bool = True,
                yours: dict | None = None):
    """The plan of ``model`` in DeepSpeed's engine space (this process plans).  ``autotp``:
    whether the script's data path gives a tensor-parallel group the same batches (tensor
    degrees are then searched where AutoTP shards the model); ``options["tp"]`` restricts them.
    ``yours``: the script's own setting as search restrictions (``mbs``, and ``zero``,
    ``recompute``, ``tp`` where it gave them), costed as a candidate (:func:`against_yours`)."""
    from ..search.engine_space import search_engine_space
    from ..spec import SpecError, load_cluster
    autotp = autotp and autotp_of(model)
    if options.get("plan"):
        return premade_plan(options, autotp)
    name = f"{type(model).__name__}"
    spec = model_spec(model, seq, sample, name)
    trainable = trainable_of(model, spec)
    base = {**(fix or {}), **({"tp": options["tp"]} if options.get("tp") else {})}
    try:
        cluster = load_cluster(options["cluster"])

        def best(extra):
            return search_engine_space(spec, cluster, global_batch, checkpointing=checkpointing_of(model),
                                       precision=precision, world_size=world, trainable=trainable,
                                       fix={**base, **extra}, autotp=autotp).plan
        plan = best({})
    except SpecError as e:
        raise AutoplanRefused(f"planning {name} for DeepSpeed's engine failed: {e}") from None
    if yours:
        plan = against_yours(plan, {k: v for k, v in yours.items() if k not in base}, best)
    if spec.config.get("note"):
        plan.notes.append(spec.config["note"])
    return plan


def against_yours(plan, yours: dict, best):
    """The plan, or the script's own setting ``yours`` (restrictions of the engine space,
    costed by ``best(fix)``) where the plan is not predicted faster by more than
    :data:`YOURS_MARGIN`: a user's batch split and config are never replaced without a
    predicted gain.  The verdict is the plan's first note ("kept yours: ..." or "N.NNx faster
    than yours (predicted): ...")."""
    from ..spec import SpecError
    try:
        try:
            theirs = best(yours)
        except SpecError:
            if "zero" not in yours or plan.dp > 1:
                raise
            # one replica: the space has ZeRO-0 only (a ZeRO stage partitions over replicas)
            yours = {k: v for k, v in yours.items() if k != "zero"}
            theirs = best(yours)
    except SpecError as e:
        plan.notes.insert(0, f"yours ({_setting(yours)}) does not fit: {e}")
        return plan
    t_plan, t_yours = plan.predicted.iteration_time_s, theirs.predicted.iteration_time_s
    if t_plan < t_yours * (1 - YOURS_MARGIN):
        plan.notes.insert(0, f"{t_yours / t_plan:.2f}x faster than yours (predicted): yours, "
                             f"{describe_module_plan(theirs)}, {t_yours:.4g} s per iteration")
        return plan
    theirs.notes.insert(0, f"kept yours ({_setting(yours)}): the best other plan is not predicted "
                           f"faster ({t_yours / t_plan:.2f}x)")
    return theirs


def _setting(yours: dict) -> str:
    names = {"mbs": "micro-batch", "zero": "ZeRO", "recompute": "recompute", "tp": "AutoTP tp"}
    return ", ".join(f"{names.get(k, k)} {v}" for k, v in yours.items())


def yours_note(plan) -> str | None:
    """The plan's verdict on the user's own setting (:func:`against_yours`), if any."""
    first = plan.notes[0] if plan.notes else ""
    return first if first.startswith(("kept yours", "yours (")) or " than yours " in first else None


def yours_of(conf: dict, mbs, same_batch: bool, recompute: bool | None = None) -> dict | None:
    """The script's own setting as the planner's restrictions (:func:`against_yours`):
    its micro-batch and, where its config gives them as numbers, ZeRO stage and AutoTP degree;
    None where its split is not one of this global batch (another was asked for)."""
    from ..emit.deepspeed import config_value
    if not isinstance(mbs, int) or mbs < 1 or not same_batch:
        return None
    out = {"mbs": mbs}
    zero = config_value(conf, "zero_optimization.stage", None)
    if isinstance(zero, int) and not isinstance(zero, bool):
        out["zero"] = zero
    tp = config_value(conf, "tensor_parallel.autotp_size", None)
    if isinstance(tp, int) and tp > 1:
        out["tp"] = tp
    if recompute is not None:
        out["recompute"] = "full" if recompute else "none"
    return out


def say_yours(plan) -> None:
    """Print the plan's verdict on the user's own setting, if it has one."""
    note = yours_note(plan)
    if note:
        say(note)


def option(options: dict, name: str, value) -> str:
    """How the user restricts the search by ``name`` in the form they launched with: a flag of
    ``ds-autoplan launch`` (``--pp 2``) or, for ``deepspeed --autoplan``, which takes no flags
    of ours, the environment variable (``DS_AUTOPLAN_PP=2``)."""
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    if options.get("via") == "launch":
        return f"--{name.replace('_', '-')} {value}"
    return f"DS_AUTOPLAN_{name.upper()}={value}"


def premade_plan(options: dict, autotp: bool):
    """The plan made before launch (``DS_AUTOPLAN_MODEL`` / ``ds-autoplan launch --model``), for a
    script whose module DeepSpeed's own engine runs: refused, naming what, when that engine
    cannot run it (a pipeline needs a PipelineModule script)."""
    from ..plan import Plan
    plan = Plan.load(options["plan"])
    what = [f"{k}={getattr(plan, k)}" for k in ("pp", "cp", "ep") if getattr(plan, k) > 1]
    if plan.tp > 1 and plan.parallel.sequence_parallel:
        what.append(f"tp={plan.tp} with sequence parallelism")
    elif plan.tp > 1 and not autotp:
        what.append(f"tp={plan.tp}, which DeepSpeed's AutoTP does not run for this module")
    if what:
        given = "--model" if options.get("via") == "launch" else "DS_AUTOPLAN_MODEL"
        raise AutoplanRefused(
            f"the plan made before launch ({plan.model}, {given}) uses {', '.join(what)}, but the "
            "script's model is not a PipelineModule: DeepSpeed's engine runs it with data "
            f"parallelism, ZeRO and AutoTP only; launch without {given} to plan the module itself"
            + (f", or restrict the plan with {option(options, 'pp', 1)}" if plan.pp > 1 else ""))
    return plan


def shared_plan(make, options: dict) -> "Plan":
    """Rank 0 runs ``make(world, options)`` with ``options["cluster"]`` resolved for this launch
    (none or ``auto``: detected from every rank's facts, runtime/nodes.launch_cluster; the
    launch's nodes are checked alike either way); every rank gets the same plan, or the same
    refusal (never a hang).  Initialises DeepSpeed's process group first when the script has
    not.  Planning draws random numbers on rank 0 (layers profiled, dropout included; a device
    measured): the script's generators continue as if it had not planned."""
    import deepspeed
    import torch.distributed as dist

    from ..plan import Plan
    if not dist.is_initialized():          # as deepspeed.initialize would
        from ..runtime.watchdog import process_group_timeout
        deepspeed.init_distributed(timeout=process_group_timeout())
    from ..runtime.common.collectives import broadcast_text
    from ..runtime.nodes import launch_cluster
    options = dict(options)
    mine = ""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        if not options.get("plan"):     # every rank: its facts (--cluster auto: the detected cluster)
            options["cluster"] = launch_cluster(options.get("cluster"), out_dir(options),
                                                options.get("remeasure", False))
        if dist.get_rank() == 0:
            try:
                mine = json.dumps(make(dist.get_world_size(), options).to_dict())
            except UserError as e:
                mine = json.dumps({"error": str(e)})
    shared = json.loads(broadcast_text(mine))       # JSON text, not a pickle, between ranks
    if "error" in shared:
        raise AutoplanRefused(shared["error"])
    return Plan.from_dict(shared)


def describe_module_plan(plan) -> str:
    """One line naming a plan of the engine space."""
    t = plan.predicted.get("trainable")
    return (f"dp={plan.dp}{f' AutoTP tp={plan.tp}' if plan.tp > 1 else ''} ZeRO-{plan.zero_stage} micro-batch {plan.micro_batch_size} x "
            f"{plan.num_microbatches} accumulation steps, activation checkpointing "
            f"{'on' if any(plan.recompute_per_stage) else 'off'}"
            + (f", offload {plan.offload}" if plan.offload != "none" else "")
            + (f", trainable {t['trainable_params']:,} of {t['params']:,} parameters" if t else ""))


def seq_of(example) -> int | None:
    """Tokens of one training example (its ``input_ids``), else None; DS_AUTOPLAN_SEQ wins."""
    from ..env import env_int
    s = env_int("DS_AUTOPLAN_SEQ")
    if s:
        return s
    ids = example.get("input_ids") if isinstance(example, dict) else None
    if ids is None:
        return None
    return int(torch.as_tensor(ids).shape[-1])


def out_dir(options: dict) -> str:
    return options.get("out") or "ds_autoplan_out"


def rank0() -> bool:
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0


def say(line: str) -> None:
    """Print one ``ds-autoplan:`` line on rank 0."""
    if rank0():
        print(f"ds-autoplan: {line}", flush=True)


def write_outputs(plan, files: dict, options: dict) -> None:
    """Rank 0: plan.json and ``files`` under the launch's out folder (a failure is a warning:
    the ranks train from memory)."""
    if not rank0():
        return
    from ..outputs import text, write_folder
    out = out_dir(options)
    try:
        write_folder(out, {"plan.json": text(plan.to_json() + "\n"), **files}, complete=False)
    except UserError as e:
        say(f"warning: {e}; training goes on without writing them")
        return
    say(f"{plan.model} on {plan.cluster}: {describe_module_plan(plan)}, in DeepSpeed's engine -> "
        f"{os.path.abspath(out)}/plan.json, {', '.join(files)}")
