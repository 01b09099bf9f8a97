"""Model sources: where a trial's network comes from, declared once; how each builds, one module each.

    minigpt  JuicyTalk's own MiniGPT (``trials/models/minigpt_net.py``), gpt or llama ``arch``; the default
    hf       a Hugging Face transformers causal LM from its config, by model type (``hf:llama``) or a
             local ``config.json`` (``hf:path/to/config.json`` or its folder); random seeded init, offline
    py       a user's factory (``py:<module>:<callable>``, module dotted or a ``.py`` path), called with the
             trial's spec, returning an ``nn.Module`` that maps ids (batch, seq) to logits (batch, seq, vocab)

The ``model`` trial field names the source and its target (``hf:qwen2``). Each source module has

    build(spec, precision, device) -> Built       the seeded FP32/BF16 module (``torch.manual_seed(spec.seed)``
                                                  first), which a stack then converts (trials/backends)
    describe(spec) -> Facts                       class, resolved config and parameter count, without
                                                  building real weights (the dry run shows them)
    check(spec) -> None                           raise ModelError for a model that cannot be built (the
                                                  spec's check_model turns it into a SpecError before Ray
                                                  or any trial starts), or whose units a trial needs and
                                                  cannot find
    units(model) -> tuple[str, ...]               the qualified names of the model's units (one per decoder
                                                  layer, in order; () where none are found): what FSDP2
                                                  shards one by one and activation checkpointing recomputes.
                                                  The stacks convert modules in place, so the names hold
                                                  on the converted model; the rule is the table's ``units``

``common.py`` holds what the sources share (the Built model, the logits adapter). The table below says,
once, what each source supports: which stacks build its models, how TE takes them (MiniGPT: TE builds
its own te blocks, ``te_layer`` transformer_layer or modules; any other model: TE converts the module
the source builds, ``te_layer`` swap or transformer_layer, trials/backends/te_convert.py), whether
inference, CUDA graphs (for which workloads; training's whole forward or unit by unit) and multi-rank trials
apply (inference: which trials/workloads/serving module serves the source's models), and whether MiniGPT's
closed forms hold (elsewhere FLOPs are counted). Importing this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

# How TE takes a model it did not build (trials/backends/te_convert.py): swap its Linears and norms for TE's
# modules, or replace transformers' Llama-family decoder layers by te.TransformerLayer; the first is the default.
CONVERTED_TE_LAYERS = ("swap", "transformer_layer")
# Serving a model TE converted (trials/workloads/serving/hf.py): its swapped te.Linear / te.RMSNorm sit inside transformers'
# own attention, so transformers' cache works; te.TransformerLayer keeps its KV cache in TE's InferenceParams
TE_LAYER_NOT_SERVED = ("serving te_layer transformer_layer is not built (te.TransformerLayer keeps its KV cache "
                       "in TE's InferenceParams, not in transformers' cache); use te_layer swap")


@dataclass(frozen=True)
class Source:
    name: str
    stacks: tuple[str, ...]  # the stacks (trials/backends) that build this source's models
    parallel: bool  # multi-rank trials (DDP, FSDP2 over its units) are built for it
    # the workloads whose ``cuda_graphs: true`` is built for it (train: forward+backward captured; infer: the
    # decode step captured and replayed)
    graphs: tuple[str, ...]
    # train: the whole forward captured as one graph (a forward that runs no host code: MiniGPT's), else each unit
    # as its own graph, the root eager between them (trials/workloads/unit_graphs.py)
    graphs_whole: bool = False
    # the trials/workloads/serving module that serves its models (the inference workload); '' where none is built
    server: str = ""
    own: bool = False  # JuicyTalk's own network: ``arch``, the shape defaults and the analytic FLOP formula apply
    why_not: str = ""  # what a refused stack or workload is told
    # how TE takes this source's models: the ``te_layer`` values, the default first; ``te_own``: TE builds the
    # network from its own modules (MiniGPT's te blocks), else it converts the module the source builds
    te_layers: tuple[str, ...] = CONVERTED_TE_LAYERS
    te_own: bool = False
    # how the source finds its model's units (FSDP2's, activation checkpointing's): said in errors and docs
    units: str = ""
    # its sizes may come from a config class's defaults where the sweep set none (``Facts.defaults``); MiniGPT's are
    # the spec's, a factory's its own: a plan of their cells need not describe them (which imports torch) to say so
    config_defaults: bool = False

    @property
    def infer(self) -> bool:
        """The inference workload is built for it."""
        return bool(self.server)

    def graphs_built(self, workload: str) -> bool:
        """``cuda_graphs: true`` is built for ``workload`` on this source's models."""
        return workload in self.graphs

    def te_unsupported(self, workload: str, te_layer: str | None = None) -> str:
        """Why TE cannot run ``workload`` with ``te_layer`` (None: the source's default) on this source's models
        ('' where it can): the one place that says it."""
        layer = te_layer or self.te_layers[0]
        if workload == "infer" and not self.te_own and layer == "transformer_layer":
            return TE_LAYER_NOT_SERVED
        return ""


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("minigpt", ("te", "torch", "torchao"), parallel=True, graphs=("train", "infer"), graphs_whole=True,
           server="minigpt", own=True, te_layers=("transformer_layer", "modules"), te_own=True,
           units="each of its blocks"),
    # decode graphs through transformers' StaticCache (trials/workloads/serving/hf.py); training graphs each decoder
    # layer (transformers' mask code inspects its inputs on the host, which a capture of the whole forward cannot hold)
    Source("hf", ("te", "torch", "torchao"), parallel=True, graphs=("train", "infer"), server="hf",
           config_defaults=True,
           units="each module of a class its _no_split_modules names (its decoder layers), else each child of its "
                 "largest nn.ModuleList"),
    # a factory's module serves when it is a transformers causal LM (trials/workloads/serving/hf.py says why), else the
    # cell is unsupported with that reason
    Source("py", ("te", "torch", "torchao"), parallel=True, graphs=("train", "infer"), server="hf",
           units="the submodules its module's fsdp_units attribute names (a list of qualified names), else each "
                 "child of its largest nn.ModuleList"),
)}
DEFAULT_MODEL = "minigpt"
# The folder a relative file path in ``model`` (``py:examples/my_model.py:build``, ``hf:configs/tiny.json``) is
# read from: the user wrote it as for ``python file.py``, relative to where they ran juicytalk. A sweep's trials
# run in a folder of their launcher's, so the driver hands them its working directory in this variable
# (orchestrator/launchers/base.py: trial_env); unset (``juicytalk trial``, the driver's own checks and dry run),
# the process's working directory is that folder. The ``model`` value, the cell id and the record keep the
# path as written. A dotted ``py:`` module is imported with this folder first on sys.path (trials/models/py.py),
# for the same reason.
CWD_ENV = "JUICYTALK_CWD"


def run_folder() -> str:
    """The folder juicytalk was run in: :data:`CWD_ENV` in a sweep's trial, else this process's working directory."""
    return os.environ.get(CWD_ENV) or os.getcwd()


def user_path(text: str) -> Path:
    """A file or folder path from ``model`` as an absolute path: ``~`` expanded, a relative one joined to
    :func:`run_folder`."""
    path = Path(text).expanduser()
    return path if path.is_absolute() else Path(run_folder(), path)


def not_found(text: str, path: Path, what: str = "file") -> str:
    """One line: no ``what`` at ``path`` (``text`` through :func:`user_path`), which folder a relative path was
    read from, and, in a sweep's trial, that a trial on another node of a Ray cluster opens the same path there."""
    why = [] if Path(text).expanduser().is_absolute() else [
        f"a relative path is read from the folder juicytalk ran in, {run_folder()}"]
    if note := cluster_note(f"the {what}"):
        why.append(note)
    return f"no {what} at {path}" + (f" ({'; '.join(why)})" if why else "")


def cluster_note(what: str) -> str:
    """In a sweep's trial (:data:`CWD_ENV` set), that every node of a Ray cluster that runs trials needs ``what``
    at the same absolute path; '' elsewhere (``juicytalk trial``, the driver's checks)."""
    if not os.environ.get(CWD_ENV):
        return ""
    return (f"this trial runs on {socket.gethostname()}: on a Ray cluster every node that runs trials needs {what} "
            "at this same absolute path (a shared filesystem, or a copy on each node)")


class ModelError(ValueError):
    """The ``model`` field names something that cannot be built (the spec turns it into a SpecError);
    ``field`` names the trial field at fault (``model`` unless a shape override is)."""

    def __init__(self, message: str, field_name: str = "model"):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``model`` value: its source and what follows the colon (a model type, a path, module:callable)."""

    source: Source
    target: str = ""

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.source.name}")


def parse(model: str) -> ModelRef:
    """``minigpt`` | ``hf:<model_type or path>`` | ``py:<module>:<callable>`` -> ModelRef; ModelError if malformed."""
    name, sep, target = model.partition(":")
    source = SOURCES.get(name)
    if source is None or bool(sep) != (name != DEFAULT_MODEL) or (sep and not target.strip()):
        raise ModelError(f"must be minigpt, hf:<model_type> (e.g. hf:llama), hf:<path to config.json or its folder> "
                         f"or py:<module>:<callable>; got {model!r}")
    if name == "py" and (":" not in target or not all(p.strip() for p in target.rsplit(":", 1))):
        raise ModelError(f"py: needs <module>:<callable> (e.g. py:examples.my_model:build); got {model!r}")
    return ModelRef(source, target)


@dataclass(frozen=True)
class Facts:
    """What a spec's model is, before its weights exist: for the record and the dry run.

    ``shape``: the shape fields as the model has them (the config's values where the spec gave none);
    ``analytic``: MiniGPT's ModelConfig where the FLOP formula of trials/measure/metrics.py applies, else None
    (FLOPs are counted).
    """

    model_class: str
    config_json: str | None
    n_params: int | None
    shape: dict[str, Any]
    analytic: Any = None
    attn_width: int | None = None  # heads x head dim: the causal attention term of counted FLOPs
    model_type: str | None = None  # transformers' config.model_type (hf); None for MiniGPT and py: factories
    # hf: the size values transformers' config class supplied, config name -> value (neither the sweep nor the
    # config file gave them); None where the source has no such defaults (MiniGPT's are the spec's, py: the factory's)
    defaults: dict[str, Any] | None = None
    attn_implementation: str | None = None  # hf: transformers' attention the model was built with (sdpa, eager)
    # hf: which built layers hold experts, where the config has any ('2 dense layers, no MoE layer
    # (first_k_dense_replace=3)'); '' elsewhere
    moe_layers: str = ""

    @property
    def n_layers(self) -> int | None:
        return self.shape.get("n_layers")

    def record(self) -> dict[str, Any]:
        return {"model_class": self.model_class, "model_config": self.config_json, "n_params": self.n_params,
                "config_defaults": None if self.defaults is None else json.dumps(self.defaults, sort_keys=True),
                "attn_implementation": self.attn_implementation}


def build(spec: Any, precision: str, device: str) -> Any:
    """The seeded FP32 (fp32 cells) or BF16 (all others) model of ``spec`` on ``device`` (a ``common.Built``)."""
    import torch

    torch.manual_seed(spec.seed)
    return parse(spec.model).module.build(spec, precision, device)


def describe(spec: Any) -> Facts:
    return parse(spec.model).module.describe(spec)


def check(spec: Any) -> None:
    """Raise ModelError when ``spec.model`` cannot be built (transformers missing, unknown type, bad factory)."""
    parse(spec.model).module.check(spec)


def units(spec: Any, model: Any) -> tuple[str, ...]:
    """The qualified names of ``model``'s units (its source's rule, the table's ``units``); () where none."""
    return tuple(parse(spec.model).module.units(model))


def needs_units(spec: Any) -> str:
    """The trial field that needs the model's units ('' where none does): FSDP2 shards them, checkpointing
    recomputes them (DDP replicates the whole model)."""
    if spec.parallel == "fsdp":
        return "parallel"
    return "activation_checkpointing" if spec.activation_checkpointing != "none" else ""


def check_units(spec: Any, model: Any) -> tuple[str, ...]:
    """``model``'s units; ModelError naming the field that needs them when the spec needs units and there are none."""
    return require_units(spec, units(spec, model))


def require_units(spec: Any, found: tuple[str, ...]) -> tuple[str, ...]:
    """``found``, the model's units; ModelError naming the field that needs them where the spec does and there
    are none."""
    field_name = needs_units(spec)
    if field_name and not found:
        source = parse(spec.model).source
        raise ModelError(f"{spec.model}: {field_name} {getattr(spec, field_name)} needs the model's units (its "
                         f"decoder layers) and none were found; {source.name} models take {source.units}",
                         field_name)
    return found
