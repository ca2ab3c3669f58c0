"""ZeRO-3's gathered parameters through a step: DeepSpeed's parameter coordinator replayed on the model's
module tree (deepspeed 0.19 runtime/zero/partitioned_param_coordinator.py, parameter_offload.py).

Every module gets hooks: its pre-forward (pre-backward) hook ``fetch_sub_module`` gathers the module's own
parameters (a ZeRO-3 leaf module's: all of its subtree's), pops them off the parameter queue, then prefetches
the next parameters of the trace up to ``min(stage3_max_live_parameters - available,
stage3_prefetch_bucket_size)`` elements, the last one whole; its post-forward (post-backward) hook, after its
children, ``release_sub_module`` releases its parameters unless one was prefetched for a later use
(``__most_recent_step_id_param_fetched_for``) or appears in the modules within ``stage3_max_reuse_distance``
elements ahead (``__params_to_release``: their own parameters, their subtrees' when the released module is a
leaf). ``stage3_max_live_parameters`` therefore limits prefetching only: a module is gathered whole whatever
its size, and what is reused soon stays. The trace runs the tree forward (children in execution order) and
backward (children reversed; the rotary embedding has no backward).

Persistent parameters (numel <= ``stage3_param_persistence_threshold``) are always whole and not counted
here (states.py counts them); they do count in the reuse distance. A block checkpointed whole (full, op) runs
its forward again inside the backward; what that recomputation saves for backward stays allocated until the
module's backward whatever the coordinator releases (``gathered``). Not replayed: blocks recomputed in part
(attention, mlp, selective).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

from autotune.memory import moe
from autotune.memory.mixed import layer_kinds
from autotune.memory.modules import parts
from autotune.spec import ModelSpec


class Gathered(NamedTuple):
    """Gathered (non-persistent) parameter elements at the step's instants."""

    forward: int
    """The most during the forward."""
    head_backward: int
    """During the output head's backward (its weight gathered)."""
    after_head: int
    """The most after the head's backward: the final norm's, the blocks' and the embedding's."""
    released_experts: tuple[int, ...] = ()
    """Per block, the elements of its experts' 3-D weights released after its forward (0: kept, or a dense
    block). Their gathered copies stay allocated anyway until the block's backward: the experts' grouped_mm
    saves a transposed view of each for its backward (transformers integrations/moe.py ``_grouped_linear``:
    ``weight.transpose(-2, -1)``) and DeepSpeed releases by rebinding ``param.data``
    (partition_parameters.py ``free_param``), which leaves the view's storage alive (not for weights stored
    transposed, ``ModelSpec.experts_transposed``: grouped_mm saves the parameter itself)."""


class _Node(NamedTuple):
    own: tuple[int, ...]               # parameter ids it fetches (a leaf module: its whole subtree's)
    children: tuple["_Node", ...]
    leaf: bool = False                 # a ZeRO-3 leaf module: no parameter of its own, its children's fetched
    backward: bool = True              # runs a backward (the rotary embedding does not)

    def direct(self) -> tuple[int, ...]:
        """What ``iter_params(module, recurse=False)`` yields: a leaf block's parameters are its children's."""
        return () if self.leaf else self.own

    def subtree(self) -> tuple[int, ...]:
        return self.own + tuple(p for c in self.children for p in c.subtree())  # a leaf's own is its subtree


def _tree(m: ModelSpec) -> tuple[_Node, list[int], list[_Node], list[tuple[int, ...]]]:
    """The module tree of an HF causal LM (CausalLM > model > embed, rotary, layers > norm, attention, norms,
    feed-forward; final norm; lm_head), each parameter's elements (ids in execution order), the blocks' nodes
    and each block's experts' 3-D weights (ids; none for a dense block)."""
    pt = parts(m)
    sizes: list[int] = []

    def mod(shapes: tuple[tuple[int, int], ...], leaf: bool = False) -> _Node:
        ids = tuple(range(len(sizes), len(sizes) + len(shapes)))
        sizes.extend(n for _, n in shapes)
        return _Node(ids, (), leaf)

    def container(children: list[_Node], own: tuple[int, ...] = ()) -> _Node:
        return _Node(own, tuple(children))

    embed = [mod(x) for x in pt.embed]
    rotary = [] if m.position_embedding == "learned" else [_Node((), (), backward=False)]
    layers, experts = [], []
    for dense in layer_kinds(m) or (not m.is_moe,) * m.num_hidden_layers:
        norms = [mod(x) for x in pt.norms[:1]]
        attention = pt.attention
        sinks = mod(attention[0]).own if m.attention_sinks else ()  # GptOssAttention's own parameter
        attention = attention[1:] if m.attention_sinks else attention
        attn = container([mod(x) for x in attention + pt.qk_norm + pt.o], own=sinks)
        later = [mod(x) for x in pt.norms[1:]]
        if dense:
            ffn = container([mod(x) for x in pt.dense_mlp])
        elif m.zero3_leaf_block:
            ffn = mod(pt.moe_ffn[0], leaf=True)
        else:  # the router runs first; the routed experts, then the shared ones (their own MLP module)
            routed = pt.moe_ffn[:2][::-1] if m.router_after_experts else pt.moe_ffn[:2]
            shared = [container([mod(x) for x in pt.moe_ffn[2:5]])] if m.shared_expert_intermediate_size else []
            gate = [mod(x) for x in pt.moe_ffn[5 if shared else 2:]]
            ffn = container([mod(x) for x in routed] + shared + gate)
        # the weights grouped_mm reads through a transposed view (none when stored transposed: gpt-oss)
        weights = set(moe.expert_weight_elements(m)) if not (dense or m.experts_transposed) else set()
        experts.append(tuple(p for p in ffn.subtree() if sizes[p] in weights))
        layers.append(container(norms + [attn] + later + [ffn]))
    final = mod(pt.norm[0])
    head = pt.head[0] if pt.head else ()
    if m.tie_word_embeddings:  # the head's weight is the embedding's (id 0), its bias its own
        head_node = _Node((0,) + mod(head).own if head else (0,), ())
    else:
        head_node = mod(head)
    return container([container(embed + rotary + layers + [final]), head_node]), sizes, layers, experts


def _trace(root: _Node, recomputed: frozenset[int] = frozenset()) -> tuple[list[_Node], list[tuple[str, _Node, int]]]:
    """The modules in fetch order, and the events: ("fetch", node, step), ("release", node, steps fetched) and
    ("recompute-release", node, steps fetched) for a module of a block's recomputed forward.
    ``recomputed``: the ids of blocks checkpointed whole; in the backward each is entered, then the modules
    whose pre-backward hooks fire before the first saved tensor is unpacked (the last-run chain down to a
    module with parameters), then the block's forward runs again, then the rest of its backward (DeepSpeed's
    trace on torch's non-reentrant checkpoint, allocation and coordinator logs, torch 2.13 CPU)."""
    order: list[_Node] = []
    events: list[tuple[str, _Node, int]] = []
    again = False  # inside a recomputed forward

    def enter(node: _Node) -> None:
        events.append(("fetch", node, len(order)))
        order.append(node)

    def run(node: _Node, backward: bool) -> None:
        nonlocal again
        if backward and not node.backward:
            return
        if backward and id(node) in recomputed:
            chain = [node]
            enter(node)
            while chain[-1].children and not chain[-1].own:
                chain.append([c for c in chain[-1].children if c.backward][-1])
                enter(chain[-1])
            again = True
            for c in node.children:  # the block's forward again
                run(c, False)
            again = False
            for parent, done in zip(chain[::-1][1:], chain[::-1]):
                for c in parent.children[::-1]:
                    if c is not done:
                        run(c, True)
                    elif not c.children:
                        events.append(("release", c, len(order)))
                events.append(("release", parent, len(order)))
            if len(chain) == 1:
                events.append(("release", node, len(order)))
            return
        enter(node)
        for c in (node.children[::-1] if backward else node.children):
            run(c, backward)
        events.append(("recompute-release" if again else "release", node, len(order)))

    run(root, False)
    run(root, True)
    return order, events


@functools.lru_cache(maxsize=1024)
def gathered(m: ModelSpec, persistence_threshold: int, max_live: int, max_reuse: int, prefetch: int,
             recomputed: tuple[int, ...] = ()) -> Gathered:
    """The gathered parameter elements of one rank through a training step (module docstring); ``recomputed``:
    the blocks checkpointed whole (full or op), run again inside the backward."""
    root, sizes, layers, experts = _tree(m)
    order, events = _trace(root, frozenset(id(layers[i]) for i in recomputed))
    released: set[int] = set()  # expert weights released during the forward
    persistent = [n <= persistence_threshold for n in sizes]
    subtrees = [node.subtree() for node in order]
    fetches = [node.own for node in order]
    directs = [node.direct() for node in order]
    head = root.children[1]
    head_bwd = max(i for i, node in enumerate(order) if node is head)
    # record_parameters: each fetch's parameters (sorted by ds_id) with the step that uses them
    queue = collections.deque((p, t) for t, own in enumerate(fetches) for p in sorted(set(own)))
    fetched_for: dict[int, int] = collections.defaultdict(lambda: -(10 ** 18))
    avail: set[int] = set()
    live = [0] * len(order)
    n_avail = 0
    # released during a block's recomputed forward but saved for its backward: torch's non-reentrant checkpoint
    # keeps what the recomputation saves as a detached alias (torch/utils/checkpoint.py _recomputation_hook:
    # ``x.detach()``), which DeepSpeed's release (``param.data`` rebound) does not free, until the module's
    # backward; the module's pre-backward hook gathers a second copy meanwhile
    held: dict[int, int] = {}
    n_held = 0
    for kind, node, t in events:
        if kind == "fetch":
            for p in node.own:
                if not persistent[p] and p not in avail:
                    avail.add(p)
                    n_avail += sizes[p]
            todo = {p for p in node.own if fetched_for[p] < t}
            popped: set[int] = set()
            while queue and len(popped) < len(todo):
                p, step = queue.popleft()
                fetched_for[p] = step
                popped.add(p)
            if prefetch > 0:
                budget, numel, chosen = min(max_live - n_avail, prefetch), 0, set()
                while queue and numel < budget:
                    p, step = queue.popleft()
                    fetched_for[p] = max(fetched_for[p], step)
                    if not persistent[p] and p not in avail and p not in chosen:
                        chosen.add(p)
                        numel += sizes[p]
                avail |= chosen
                n_avail += numel
            live[t] = n_avail + n_held
            continue
        n_held -= held.pop(id(node), 0)  # the module's backward done: its saved aliases freed
        # release at step t (fetches so far): not what was prefetched for a later step, nor what is reused
        # within the reuse distance ahead
        release = {p for p in node.own if not persistent[p] and p in avail and fetched_for[p] <= t}
        traversed = 0
        for later in range(t, len(order)):
            if traversed >= max_reuse or not release:
                break
            for p in (subtrees[later] if node.leaf else directs[later]):
                release.discard(p)
                traversed += sizes[p]
        for p in release:
            avail.discard(p)
            n_avail -= sizes[p]
        if kind == "recompute-release" and release:
            kept = sum(sizes[p] for p in release)
            held[id(node)] = held.get(id(node), 0) + kept
            n_held += kept
        if t <= head_bwd:
            released |= release
    return Gathered(max(live[:head_bwd], default=0), live[head_bwd], max(live[head_bwd + 1:], default=0),
                    tuple(sum(sizes[p] for p in ids if p in released) for ids in experts))
