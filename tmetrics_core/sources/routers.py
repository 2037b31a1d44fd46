"""Router sources found in the model: MoE router logits, scores and top-k choices with no user code.

One path for every framework: a :class:`Recognizer` says, as data, how to find one framework's
router modules (the top-level package and a glob of the class name, or a structural rule) and
what each element of their forward output is. :func:`find_routers` scans the model once at
construction; on a run configured with a metric reading router outputs, :func:`install` puts
one forward hook on each router (kept until ``close()``, like every module-side source, so a
compiled model sees the same hooks on every step). Each
call observes, as the sites ``<MoE block path>.router_logits``, ``.router_scores`` and
``.router_topk`` (the MoE block is the router's parent module), exactly what a model calling
``tm.observe(block, "router_logits", ...)`` would:

- ``router_logits`` ``[tokens, E]`` and ``router_topk`` ``[tokens, k]`` integer global ids;
- ``router_scores`` ``[tokens, E]``: the router's full score distribution. Where the router returns
  it (torchtitan) it is read as returned; where it returns only the logits and its top-k weights
  (transformers 5), the scores are ``softmax`` or ``sigmoid`` of the logits, whichever the
  returned weights are proportional to at the chosen ids (normalized or scaled top-k weights
  keep that proportion). The score function is verified on the router's first observed call,
never assumed.

What is recognised is verified on every call: the logits and scores must have ``E`` columns and
the choices be integer ids with ``k`` columns (``E`` and ``k`` read from the router module
itself), or every router metric of the step is failed with the reason (never a count of the
wrong tensor); where no score function fits the returned weights, the metrics reading
``router_scores`` are failed (they would otherwise fall back to ``softmax`` of the logits).

Recognised (:data:`RECOGNIZERS`):

- transformers 5.x router modules (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
  ``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ``DeepseekV3TopkRouter``, ``GptOssTopKRouter``
  and every other class of ``transformers`` whose name ends in ``Router`` with an ``[E, hidden]``
  weight and an integer ``top_k``), returning ``(logits, top-k weights, top-k ids)``;
- transformers 4.x gates: an ``nn.Linear`` named ``gate`` whose parent holds ``experts`` as an
  ``nn.ModuleList`` of as many experts as the gate has outputs (Mixtral ``block_sparse_moe``,
  Qwen2-MoE, Qwen3-MoE, OLMoE ``mlp``): only the logits, since a 4.x block computes its top-k
  choice inside its own forward (tokens-per-expert needs ``tm.observe`` there);
- Switch Transformers' ``SwitchTransformersTop1Router`` (transformers 5, one module per expert),
  returning ``(dispatch mask [.., E], top-1 probability, logits)``: the mask is read as the top-1
  ids where no token was dropped over an expert's capacity (else the router metrics fail with
  that reason; the dropped count is not what the router chose);
- torchtitan's ``TokenChoiceTopKRouter``, returning ``(top-k scores, top-k ids, scores [.., E])``
  with ids global under expert parallelism; DTensor outputs (sequence parallel) are passed as
  they are: their placements say which axis splits the tokens.

Megatron-Core's ``TopKRouter`` computes its logits in an inner method and returns masked
probabilities; its observation stays with its integration (``integrations/megatron.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import AbstractSet, Any, Callable

import torch

from tmetrics_core.kinds import ROUTER_OUTPUT_KINDS
from tmetrics_core.sources.hook_context import HookContext
from tmetrics_core.sources.modules import ModuleIndex

__all__ = ["RECOGNIZERS", "Recognizer", "Router", "find_routers", "install"]

SCORE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: torch.softmax(logits.float(), dim=-1),
    "sigmoid": lambda logits: torch.sigmoid(logits.float()),
}
"""Candidate score functions of routers that return only logits and top-k weights, tried in order."""


@dataclass(frozen=True)
class Recognizer:
    """How one framework's router modules are found and read.

    Attributes:
        package: top-level package defining the router class (``transformers``, ``torchtitan``);
            ``torch`` for the structural 4.x gate rule.
        classes: glob on the router's class name (``*Router``, ``TokenChoiceTopKRouter``).
        outputs: the kind each element of the forward output holds: ``router_logits``,
            ``router_topk``, ``router_scores`` (full ``[.., E]`` scores), ``topk_weights`` (the
            ``[.., k]`` weights the experts are mixed with, used to verify the score function),
            ``dispatch_mask`` (a ``[.., E]`` 0/1 mask of the experts each token is sent to, read
            as ``router_topk`` ids where every token is sent to ``k`` experts) or None (not read).
            A single tensor output is the first element.
        experts: attribute giving ``E``: ``weight`` (its rows) or an int attribute (``num_experts``).
        top_k: int attribute giving ``k``, or ``k`` itself (top-1 routers without one); None
            where the router does not choose (4.x gates).
        gate_of_expert_list: the structural 4.x rule: the module is a child named ``gate`` of a
            module holding ``experts`` as an ``nn.ModuleList`` of ``E`` experts.
    """

    package: str
    classes: str
    outputs: tuple[str | None, ...]
    experts: str
    top_k: str | int | None = "top_k"
    gate_of_expert_list: bool = False


RECOGNIZERS: tuple[Recognizer, ...] = (
    Recognizer("transformers", "SwitchTransformersTop1Router", ("dispatch_mask", "topk_weights", "router_logits"),
               experts="num_experts", top_k=1),
    Recognizer("transformers", "*[Rr]outer", ("router_logits", "topk_weights", "router_topk"), experts="weight"),
    Recognizer("torch", "Linear", ("router_logits",), experts="weight", top_k=None, gate_of_expert_list=True),
    Recognizer("torchtitan", "TokenChoiceTopKRouter", ("topk_weights", "router_topk", "router_scores"),
               experts="num_experts"),
)
"""Every framework's routers, in the order they are tried on each module (first match wins)."""


@dataclass(frozen=True)
class Router:
    """One router module found in the model.

    Attributes:
        path: the router module's path (``model.layers.3.mlp.gate``).
        module: the router module, which the hook is put on.
        block: the module the observations are named after (the MoE block holding the router).
        num_experts: global expert count ``E`` (the router scores every expert).
        top_k: experts chosen per token (0 where the router does not choose).
        recognizer: how it was found and how its output is read.
        score_function: the name of its verified score function (of :data:`SCORE_FUNCTIONS`),
            once its first observed call has shown it; empty before.
    """

    path: str
    module: torch.nn.Module
    block: torch.nn.Module
    num_experts: int
    top_k: int
    recognizer: Recognizer
    score_function: list[str] = field(default_factory=list, compare=False)


def find_routers(model: torch.nn.Module, index: ModuleIndex) -> list[Router]:
    """The routers of ``model`` that some :data:`RECOGNIZERS` entry recognises, in module order.
    A plain PyTorch model pays one scan of its modules at construction and nothing per step."""
    parents: dict[int, torch.nn.Module] = {}
    for holder in model.modules():
        for child in holder.children():
            parents.setdefault(id(child), holder)
    found = []
    for path, module in index.named:
        parent = parents.get(id(module))
        if parent is None:
            continue
        for recognizer in RECOGNIZERS:
            router = _recognize(recognizer, path, module, parent)
            if router is not None:
                found.append(router)
                break
    return found


def _recognize(rule: Recognizer, path: str, module: torch.nn.Module, parent: torch.nn.Module) -> Router | None:
    cls = type(module)
    if cls.__module__.partition(".")[0] != rule.package or not fnmatchcase(cls.__name__, rule.classes):
        return None
    experts = getattr(module, rule.experts, None)
    experts = int(experts.shape[0]) if isinstance(experts, torch.Tensor) and experts.dim() == 2 else experts
    k = getattr(module, rule.top_k, None) if isinstance(rule.top_k, str) else rule.top_k or 0
    if not isinstance(experts, int) or experts <= 0 or not isinstance(k, int):
        return None
    if rule.gate_of_expert_list:
        expert_list = getattr(parent, "experts", None)
        if (path.rpartition(".")[2] != "gate" or not isinstance(expert_list, torch.nn.ModuleList)
                or len(expert_list) != experts):
            return None
    return Router(path, module, parent, experts, k, rule)


Fail = Callable[[str, AbstractSet[str]], None]
FailUnless = Callable[[torch.Tensor, str, AbstractSet[str]], None]


def install(hooks: HookContext) -> list[Any]:
    """Forward hooks on the model's routers (``hooks.routers``) observing the router kinds read
    (the router kinds' installer) through ``hooks.record``; ``fail(reason, kinds)`` fails the
    step's metrics reading any of ``kinds``: every router metric when an output is not what the
    router was recognised as, those reading ``router_scores`` when no score function fits (the
    others still get the logits and the choices); ``fail_unless(ok, reason, kinds)`` does so at
    the step's end unless the device flag ``ok`` holds (a dispatch mask that dropped tokens), so
    the hook reads nothing back to the host. Returns the handles."""
    wanted = hooks.kinds & ROUTER_OUTPUT_KINDS
    if not wanted or not hooks.routers:
        return []
    record, fail, fail_unless = hooks.record, hooks.fail, hooks.fail_unless
    return [router.module.register_forward_hook(_hook(router, record, fail, fail_unless, wanted))
            for router in hooks.routers]


def _hook(router: Router, record: Callable[..., None], fail: Fail, fail_unless: FailUnless, wanted: frozenset[str]):
    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        parts = _read(router.recognizer, out)
        problem = (_dispatched(router, parts, fail_unless) if "router_topk" in wanted or "router_scores" in wanted
                   else None)
        problem = problem or _check(router, parts)
        if problem is not None:
            fail(problem, ROUTER_OUTPUT_KINDS)
            return
        if "router_scores" in wanted and "router_scores" not in parts:
            parts["router_scores"], problem = _scores(router, parts, fail_unless)
            if problem is not None:  # metrics reading scores would fall back to softmax(logits)
                fail(problem, frozenset({"router_scores"}))
        for kind in ("router_logits", "router_scores", "router_topk"):
            if parts.get(kind) is not None and kind in wanted:
                record(router.block, kind, parts[kind], kind=kind, shard_dim=None)
    return hook


def _read(rule: Recognizer, out: Any) -> dict[str, Any]:
    """Output elements by kind; a single tensor is the first element."""
    elements = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(elements) != len(rule.outputs):
        elements = (out,)  # checked by the hook: a tensor of another width fails
    return {kind: value for kind, value in zip(rule.outputs, elements) if kind is not None}


def _dispatched(router: Router, parts: dict[str, Any], fail_unless: FailUnless) -> str | None:
    """Reads a ``dispatch_mask`` as ``router_topk`` ids ``[.., k]``; the reason it cannot when the
    mask is not ``[tokens, experts]``, else None. Whether every token went to exactly ``k``
    experts (none dropped over an expert's capacity) is a device flag handed to
    ``fail_unless``: decided at the step's end, without a host synchronisation here."""
    mask = parts.pop("dispatch_mask", None)
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape[-1] != router.num_experts:
        return f"router {router.path}: its dispatch mask is not [tokens, {router.num_experts}]"
    fail_unless((mask.sum(dim=-1) == router.top_k).all(),
                f"router {router.path} dropped tokens over an expert's capacity (some token went to other than "
                f"{router.top_k} experts): tokens per expert would not count what it chose; raise the model's "
                "expert_capacity, or observe router_topk with tm.observe(...)", ROUTER_OUTPUT_KINDS)
    parts["router_topk"] = mask.topk(router.top_k, dim=-1).indices
    return None


def _check(router: Router, parts: dict[str, Any]) -> str | None:
    """Why the output does not match what ``router`` was recognised as, or None."""
    for kind in ("router_logits", "router_scores"):
        value = parts.get(kind)
        if value is not None and (not isinstance(value, torch.Tensor) or value.shape[-1] != router.num_experts):
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return (f"router {router.path}: its {kind.partition('_')[2]} are {shape}, not [tokens, "
                    f"{router.num_experts}] as the router module says; observe router outputs with "
                    "tm.observe(...) instead")
    chosen = parts.get("router_topk")
    if chosen is not None and (not isinstance(chosen, torch.Tensor) or chosen.is_floating_point()
                               or chosen.shape[-1] != router.top_k):
        what = f"{chosen.dtype} {list(chosen.shape)}" if isinstance(chosen, torch.Tensor) else type(chosen).__name__
        return (f"router {router.path}: its top-k choices are {what}, not integer expert ids [tokens, "
                f"{router.top_k}] as its top_k says; observe them with tm.observe(...) instead")
    return None


def _scores(router: Router, parts: dict[str, Any], fail_unless: FailUnless) -> tuple[torch.Tensor | None, str | None]:
    """The full scores ``[tokens, E]`` of a router returning logits, top-k weights and ids.

    The score function is found on the router's first observed call (one host synchronisation
    per router and run) and kept: the first of :data:`SCORE_FUNCTIONS` whose values at the chosen
    ids are proportional to the returned weights, row by row (relative tolerance
    ``max(1e-4, 8 eps)`` of the weights' dtype), preferring one they equal exactly. Under
    ``torch.compile``, where no value can be read on the host, before an uncompiled call has
    found it: the function the router's class implies (`_expected`) is used, and whether the
    weights fit it is a device flag handed to ``fail_unless`` (the metrics reading scores fail at
    the step's end if not). Returns ``(None, None)`` where the router returns no logits (nothing
    to derive); ``(None, reason)`` where no function fits, or where the weights cannot tell them
    apart (one expert per token, normalized)."""
    logits, weights, chosen = parts.get("router_logits"), parts.get("topk_weights"), parts.get("router_topk")
    if logits is None:
        return None, None
    flat = logits.detach().reshape(-1, logits.shape[-1])
    if router.score_function:
        return SCORE_FUNCTIONS[router.score_function[0]](flat), None
    if not isinstance(weights, torch.Tensor) or chosen is None or weights.shape != chosen.shape:
        return None, (f"router {router.path}: its top-k weights are not [tokens, {router.top_k}], so its score "
                      "function cannot be verified; observe router_scores with tm.observe(...) instead")
    w = weights.detach().reshape(-1, weights.shape[-1]).double()
    ids = chosen.reshape(-1, chosen.shape[-1])
    tolerance = max(1e-4, 8 * torch.finfo(weights.dtype).eps)
    if torch.compiler.is_compiling():
        name = _expected(router)
        scores = SCORE_FUNCTIONS[name](flat)
        ratio = w / scores.gather(1, ids).double()
        proportional = ((ratio - ratio[:, :1]).abs() <= tolerance * ratio[:, :1].abs()).all()
        fail_unless(proportional, f"router {router.path}: under torch.compile its scores were taken as {name} of its "
                          f"logits (from its class), but its top-k weights do not fit {name}; observe router_scores "
                          "with tm.observe(...), or run one step uncompiled first", frozenset({"router_scores"}))
        return scores, None
    fits = []
    for name, function in SCORE_FUNCTIONS.items():
        scores = function(flat)
        at = scores.gather(1, ids).double()
        ratio = w / at
        if bool(torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=tolerance, atol=0.0)):
            fits.append((name, scores, bool(torch.allclose(w, at, rtol=tolerance, atol=0.0))))
    exact = [fit for fit in fits if fit[2]]
    if len(exact) == 1 or len(fits) == 1:
        name, scores, _ = (exact or fits)[0]
        router.score_function.append(name)
        return scores, None
    why = "neither" if not fits else "more than one"
    return None, (f"router {router.path}: its top-k weights fit {why} of the score functions "
                  f"{', '.join(SCORE_FUNCTIONS)} of its logits; observe router_scores with tm.observe(...) instead")


def _expected(router: Router) -> str:
    """The score function a router's class implies, read from the module, not from values:
    ``sigmoid`` where it keeps a score-correction bias (DeepSeek-V3's ``e_score_correction_bias``:
    sigmoid scoring with auxiliary-loss-free balancing), else ``softmax`` (Mixtral, Qwen-MoE,
    OLMoE, Switch). Checked against the returned weights on the device (see `_scores`)."""
    return "sigmoid" if hasattr(router.module, "e_score_correction_bias") else "softmax"
