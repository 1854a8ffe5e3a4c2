"""How evenly the Mosaic kernels' CTAs fill the GPU's SMs: a model of the launch.

    python -m benchmarks.launch_sim                      # the fa grid at head dims 64, 128
    python -m benchmarks.launch_sim --head-dims 128 --causal true --span-band 1,2,16

Each CTA costs the steps it walks (key tiles in the forward and the dQ kernel, query
tiles of each head of its group in the dK/dV or fused kernel) plus a fixed cost of
`cta_steps`; one CTA fills an SM (the kernels take an SM's registers); CTAs go to SMs as
they free, in launch order (the grid's last axis fastest), and a persistent grid's CTA
walks the items `pipeline.persistent_item` gives it. The fill is the work over SMs x the
time to the last CTA's end: 1 when every SM is busy to the end. The model leaves out
what sets a step's time (bandwidth, L2, a step's waits), so it says what the count and
the order of the CTAs cost, nothing else: the waves of equal CTAs (2048 on 132 SMs fill
15.5 of 16 waves, 0.970) and the tail of a causal grid. No GPU; no JAX tracing.
`--add-steps A` adds one wait to the fused backward's: each dQ add waits for the lower
key span's add to the same query tile, and takes A steps (ordered_adds_fill); with
`--high-spans-first`, also that fill with the spans launched from the last down
(MosaicBwdConfig.high_spans_first); with `--l2`, how many times over that schedule
fetches its query tiles from HBM through a least-recently-used L2 (l2_rereads).
`--tokens N`: N // seq batch elements rather than the grid's 16k tokens' worth.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
from collections import OrderedDict

from pallas_flash.mosaic import bwd_config, pipeline, split_tail
from pallas_flash.mosaic import config as fwd_config
from pallas_flash.mosaic.config import padded_head_dim

H100_SMS = 132  # the H100 SXM's and the H200's SM count


def fill(costs, sms: int = H100_SMS) -> tuple[float, float]:
    """(work, time to the end) of CTAs of these costs, in launch order, each taking the
    SM that frees first."""
    free = [0.0] * min(sms, max(len(costs), 1))
    end = 0.0
    for cost in costs:
        start = heapq.heappop(free)
        end = max(end, start + cost)
        heapq.heappush(free, start + cost)
    return float(sum(costs)), end


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def causal_key_tiles(first_row: int, rows: int, block_kv: int, s: int, causal: bool) -> int:
    """Key tiles of `block_kv` a block of `rows` query rows from `first_row` walks (T = S,
    the causal mask top-left)."""
    if not causal:
        return _ceil(s, block_kv)
    return min(_ceil(first_row + rows, block_kv), _ceil(s, block_kv))


def _cta_walks(config, n: int, b: int, tiles: int, ctas: int, causal: bool, cost, rounds=None):
    """Each persistent CTA's items in the order it walks them, as (batch, head, query
    tile), as `fwd_kernel.item_at` has them: through greedy_items' lists or head_rounds'
    table (causal; `cost(tile)`: a query tile's key tiles, the list schedule's input),
    else the plain orders (`pipeline.persistent_item`); `rounds`: at most that many each
    (split_tail's whole rounds)."""
    items = n * tiles * b
    coords = lambda w: tuple(int(x) for x in pipeline.head_rounds_coords(int(w), n, tiles))  # noqa: E731
    if config.head_rounds and causal and config.greedy_items:
        costs = tuple(cost(q) for q in range(tiles))
        return [
            list(map(coords, items)) for items in pipeline.greedy_items_lists(costs, n, b, ctas)
        ]
    order = (
        pipeline.head_rounds_order(n * b, tiles, ctas) if config.head_rounds and causal else None
    )
    walks = []
    for cta in range(ctas):
        walk, i = [], 0
        while (w := int(pipeline.persistent_item(cta, i, ctas, snake=causal))) < items:
            if rounds is not None and i == rounds:
                break
            if order is not None:
                walk.append(coords(order[w]))
            else:
                walk.append(tuple(int(x) for x in split_tail.item_coords(w, n, b, tiles, causal)))
            i += 1
        walks.append(walk)
    return walks


def forward_rows(config) -> int:
    """The query rows of one forward item: a CTA's tile, or with kv_multicast a cluster's
    pair of them (forward.py's range row)."""
    return config.consumers * config.block_q * (2 if config.kv_multicast else 1)


def forward_sms(config) -> int:
    """The units the forward's grid fills: SMs, or with kv_multicast SM pairs (a cluster of
    two CTAs takes two SMs for as long as its pair of query tiles walks their keys)."""
    return H100_SMS // 2 if config.kv_multicast else H100_SMS


def forward_costs(config, t: int, b: int, n: int, causal: bool, cta_steps: float):
    """The forward's CTAs' costs in launch order, or, persistent, each CTA's summed items
    (`fwd_kernel.item_at`: causal items bottom query tiles first, tile-major when
    persistent, or with head_rounds in head order, each round's longest first, or with
    greedy_items each CTA's list (pipeline.greedy_items_order); else one
    (batch, head)'s tiles together). With kv_multicast a unit is a cluster (fill it on
    `forward_sms` units): its item is a pair of adjacent query tiles (forward.py's range
    row), both CTAs walking the pair's key range, so it costs the key tiles of the pair's
    rows (the lower tile's extra, masked ones included: multicast_own_keys skips their
    math, not their loads or the time the upper tile takes)."""
    rows = forward_rows(config)
    tiles = _ceil(t, rows)
    cost = lambda tile: causal_key_tiles(tile * rows, rows, config.block_kv, t, causal)  # noqa: E731
    if not config.persistent:  # grid (heads, q_tiles, batch), the bottom tiles first
        order = [tiles - 1 - q if causal else q for q in range(tiles)]
        return [cost(q) + cta_steps for _ in range(n) for q in order for _ in range(b)]
    items = n * tiles * b
    ctas = min(items, forward_sms(config))
    key_tiles = _ceil(t, config.block_kv)
    tail = split_tail.plan(items, ctas, key_tiles) if config.split_tail else None
    rounds = None if tail is None else tail.rounds  # split_tail: the last round in pieces
    walks = _cta_walks(config, n, b, tiles, ctas, causal, cost, rounds)
    per_cta = [sum(cost(q) + cta_steps for _, _, q in walk) for walk in walks]
    for cta in range(ctas):
        for item, lo, hi, valid in tail.pieces[cta, :, :4] if tail is not None else ():
            if valid:  # a piece walks its keys of the item's (all of them, not causal)
                q = split_tail.item_coords(item, n, b, tiles, causal)[2]
                per_cta[cta] += max(0, min(hi, cost(q)) - lo) + cta_steps
    return per_cta


def span_order(kv_heads: int, spans: int, b: int, band: int, high_first: bool = False):
    """(key/value head, key span, batch element) in the dK/dV (fused) grid's launch order
    (`backward.py`): in bands of `band` heads, each band's first spans, then its second
    ones; a band of 1 is head by head. `high_first` (high_spans_first): the spans from
    the last down."""
    return [
        (g * band + hh, spans - 1 - span if high_first else span, e)
        for g in range(kv_heads // band)
        for span in range(spans)
        for hh in range(band)
        for e in range(b)
    ]


def dkdv_units(config, t: int, b: int, k: int, causal: bool):
    """(key/value head, key span, batch element, first query tile, end tile) of each
    dK/dV (or fused) CTA in launch order: a span walks the query tiles at or below its
    first key; with split_tail the whole CTAs, then each piece a CTA (its tiles of its
    span's)."""
    keys = config.key_tiles_dkv * config.block_kv_dkv
    bq = config.block_q_dkv
    q_tiles, spans = _ceil(t, bq), _ceil(t, keys)
    lo = lambda span: span * keys // bq if causal else 0  # noqa: E731
    order = span_order(k, spans, b, config.heads_per_band(k, b), config.high_spans_first)
    units = [(h, span, e, lo(span), q_tiles) for h, span, e in order]
    tail = split_tail.even_pieces(len(order), H100_SMS, q_tiles) if config.split_tail else None
    if tail is not None:
        units = units[: tail.whole]
        for item, first, end in tail.table:
            h, span, e = order[item]
            units.append((h, span, e, max(first, lo(span)), max(end, lo(span))))
    return units


def backward_costs(config, t: int, b: int, n: int, k: int, causal: bool, cta_steps: float):
    """[(kernel, its CTAs' costs in launch order)]: the fused kernel, or the pair's dK/dV
    kernel then its dQ kernel (one after the other); a dK/dV CTA's query tiles cost each
    head of its group."""
    if config.rotated_ring or config.dkdv_q_multicast or config.dq_kv_multicast:
        raise ValueError("rotated_adds' ring and the multicasts' grids are not modelled")
    units = dkdv_units(config, t, b, k, causal)
    costs = [(end - first) * (n // k) + cta_steps for *_, first, end in units]
    out = [("fused" if config.fused else "dkdv", costs)]
    if not config.fused:
        rows = (1 if config.split_dq else config.consumers_dq) * config.block_q_dq
        tiles = _ceil(t, rows)
        order = [tiles - 1 - q if causal else q for q in range(tiles)]  # longest first
        costs = [
            causal_key_tiles(q * rows, rows, config.block_kv_dq, t, causal) + cta_steps
            for _ in range(n)
            for q in order
            for _ in range(b)
        ]
        out.append(("dq", costs))
    return out


def ordered_adds_fill(
    config, t: int, b: int, n: int, k: int, causal: bool, cta_steps: float, add_steps: float
) -> float:
    """The fused kernel's fill with its ordered dQ adds waited on (mosaic/dq_adds.py): a
    CTA walks its query tiles from the last down (dkdv_kernel.py), a step costing its
    group's heads; its share of tile j is added once the span before it in that tile's
    order (the next lower key span of the head and batch element) has added its own,
    and the add takes `add_steps`, one at a time a CTA; with two share slots, step j + 2
    waits for add j. What a turn costs on the GPU is not known, hence the parameter: 0
    gives `backward_costs`' fill. The CTAs as backward_costs' (dkdv_units). With
    high_spans_first a CTA walks upward and a tile's adds go in decreasing span, which
    is its launch order too (so the same bookkeeping: each add after the one launched
    before it to that tile). Timed, it gained a third of what this says at head dim 64
    causal and lost at 128 (docs/mosaic.md, "The spans launched from the last down"):
    nothing a step costs beyond its count and the turns is modelled here (the L2's
    share: l2_rereads)."""
    work, last_end, _ = _fused_walks(config, t, b, n, k, causal, cta_steps, add_steps)
    return work / (H100_SMS * last_end)


def _fused_walks(config, t, b, n, k, causal, cta_steps, add_steps):
    """ordered_adds_fill's schedule: (work, the last CTA's end, [(a step's start,
    key/value head, batch element, query tile)] in launch order)."""
    if not config.fused or config.rotated_ring or config.dkdv_q_multicast:
        raise ValueError(
            "the ordered adds are the fused kernel's (rotated_adds' ring not modelled)"
        )
    units = dkdv_units(config, t, b, k, causal)
    group, q_tiles = n // k, _ceil(t, config.block_q_dkv)
    added = {}  # (head, batch element): each query tile's last add's end so far
    free = [0.0] * min(H100_SMS, len(units))
    work = last_end = 0.0
    steps = []
    for h, span, e, first, end in units:  # launch order: a tile's earlier spans first
        clock = heapq.heappop(free) + cta_steps
        turns = added.setdefault((h, e), [0.0] * q_tiles)
        ends: list[float] = []
        walk = range(first, end) if config.high_spans_first else range(end - 1, first - 1, -1)
        for i, tile in enumerate(walk):
            steps.append((clock, h, e, tile))
            clock += group
            if i >= 2:  # two share slots: this share waits for the add two steps back
                clock = max(clock, ends[i - 2])
            ends.append(max(clock, ends[-1] if ends else 0.0, turns[tile]) + add_steps)
            turns[tile] = ends[-1]
        done = max([clock, *ends[-1:]])
        work += cta_steps + (end - first) * group
        last_end = max(last_end, done)
        heapq.heappush(free, done)
    return work, last_end, steps


# The H100 SXM's and the H200's L2 (both GH100 dies), bytes.
L2_BYTES = 50 * 2**20


def l2_rereads(
    config,
    t: int,
    b: int,
    n: int,
    k: int,
    causal: bool,
    head_dim: int,
    cta_steps: float = 2.0,
    add_steps: float = 0.0,
    l2_bytes: int = L2_BYTES,
) -> float:
    """How many times over the fused backward would fetch its query-side tiles from HBM
    through an L2 of `l2_bytes` kept least-recently-used: each step reads a query tile's
    Q and dO (bf16, the group's heads) and reduce-adds its float32 dQ share in L2, so a
    (head, batch element, query tile) holds QUERY_SIDE_BYTES a value there; the steps in the
    order ordered_adds_fill's schedule starts them. 1.0: every tile fetched once (the
    compulsory traffic); a causal span walks each of its tiles once, so at most the
    tile's visitors. K and V (once a CTA) and the L2's own partitioning are left out:
    a count of distances between a tile's reads, not of their time on the GPU."""
    _, _, steps = _fused_walks(config, t, b, n, k, causal, cta_steps, add_steps)
    size = config.block_q_dkv * padded_head_dim(head_dim) * (n // k) * bwd_config.QUERY_SIDE_BYTES
    return _lru_fetches([(h, e, tile) for _, h, e, tile in sorted(steps)], size, l2_bytes)


def _lru_fetches(reads, size: int, l2_bytes: int) -> float:
    """Fetches from HBM over the compulsory of `reads` (keys, in order, each `size` bytes)
    through an L2 of `l2_bytes` kept least-recently-used."""
    held: OrderedDict = OrderedDict()
    fetched = 0
    for key in reads:
        if key in held:
            held.move_to_end(key)
            continue
        fetched += 1
        held[key] = None
        if len(held) * size > l2_bytes:
            held.popitem(last=False)
    return fetched / len(set(reads))


def forward_kv_fetches(
    config,
    t: int,
    b: int,
    n: int,
    causal: bool,
    head_dim: int,
    cta_steps: float = 0.5,
    l2_bytes: int = L2_BYTES,
) -> float:
    """How many times over the forward would fetch its K and V tiles from HBM through an
    L2 of `l2_bytes` kept least-recently-used: each CTA walks its items' key tiles one a
    step (persistent, its items in turn, as `fwd_kernel.item_at` orders them, head_rounds
    and greedy_items included; else CTAs go to SMs as they free, in launch order), each
    step reading one (batch element, head, key tile)'s K and V (bf16), the steps
    replayed in the order they start. 1.0: every tile fetched once. Q, O and the L2's
    partitioning are left out: a count of distances between a tile's reads, not of
    their time on the GPU."""
    if config.split_tail or config.kv_multicast:
        raise ValueError("split_tail's pieces and kv_multicast's clusters are not modelled")
    rows = config.consumers * config.block_q
    tiles = _ceil(t, rows)
    events = []  # (start, sequence, (batch element, head, key tile))

    def walk(start: float, e: int, h: int, q: int) -> float:
        steps = causal_key_tiles(q * rows, rows, config.block_kv, t, causal)
        first = len(events)  # ties in start time keep the order the steps were walked
        events.extend((start + j, first + j, (e, h, j)) for j in range(steps))
        return start + steps + cta_steps

    if config.persistent:
        ctas = min(n * tiles * b, H100_SMS)
        cost = lambda q: causal_key_tiles(q * rows, rows, config.block_kv, t, causal)  # noqa: E731
        for items in _cta_walks(config, n, b, tiles, ctas, causal, cost):
            clock = 0.0
            for e, h, q in items:
                clock = walk(clock, e, h, q)
    else:  # grid (heads, query tiles, batch), the last axis fastest, bottom tiles first
        free = [(0.0, sm) for sm in range(H100_SMS)]
        for h in range(n):
            for q in range(tiles - 1, -1, -1) if causal else range(tiles):
                for e in range(b):
                    start, sm = heapq.heappop(free)
                    heapq.heappush(free, (walk(start, e, h, q), sm))
    size = 2 * config.block_kv * padded_head_dim(head_dim) * 2
    return _lru_fetches([key for _, _, key in sorted(events)], size, l2_bytes)


def report(
    head_dim: int,
    seq: int,
    causal: bool,
    bands,
    cta_steps: float,
    heads: int | None = None,
    add_steps: float | None = None,
    high_first: bool = False,
    l2: bool = False,
    tokens: int = 16384,
) -> str:
    """One line of the fa grid's shape (16k tokens a batch, or `tokens`; 2048 // head_dim
    heads, or `heads`):
    the forward's CTAs (or items) and fill, and the backward's in bands of each of
    `bands` heads (`MosaicBwdConfig.span_band`); with `add_steps`, the fused kernel's
    fill with its ordered adds waited on too (ordered_adds_fill), and with `high_first`
    that fill launched from the last span down (high_spans_first, the head-dim-64
    causal default's order; the split, in each band, is modelled in the plain order);
    with `l2`, the fused kernel's query-side tiles' fetches from HBM over the
    compulsory (l2_rereads, on that schedule)."""
    if tokens % seq:
        raise ValueError(f"tokens={tokens} is not a whole number of sequences of {seq}")
    b, n = tokens // seq, heads or 2048 // head_dim
    fwd = fwd_config.default_mosaic_config(head_dim, seq, causal)
    unit = "clusters" if fwd.kv_multicast else "CTAs"  # clusters of two: pairs of tiles
    units = f"items on {forward_sms(fwd)} {unit}" if fwd.persistent else unit
    items = n * _ceil(seq, forward_rows(fwd)) * b
    line = f"h{head_dim} n{n} {'causal' if causal else 'full  '} {seq:>5}: fwd {items} {units}"
    # A persistent row whole and split (whichever the default is: SPLIT_TAIL_64); a row
    # in head order (head_rounds, whose table the split's pieces do not follow) whole.
    whole = dataclasses.replace(fwd, split_tail=False, tail_fixup=False)
    splits = fwd.persistent and not fwd.head_rounds
    split = (dataclasses.replace(fwd, split_tail=True),) if splits else ()
    for config in (whole, *split):
        costs, sms = forward_costs(config, seq, b, n, causal, cta_steps), forward_sms(config)
        work, end = fill(costs, sms) if not config.persistent else (sum(costs), max(costs))
        line += f"{' split' if config.split_tail else ''} fill {work / (sms * end):.3f}"
    bwd = dataclasses.replace(
        bwd_config.default_mosaic_bwd_config(head_dim, causal),
        rotated_adds=False,
        high_spans_first=False,
    )
    for band in bands:
        for split in (False, True):
            config = dataclasses.replace(bwd, span_band=band, split_tail=split)
            parts = backward_costs(config, seq, b, n, n, causal, cta_steps)
            ends = [fill(c) for _, c in parts]
            total = sum(w for w, _ in ends) / (H100_SMS * sum(e for _, e in ends))
            names = "+".join(f"{name} {len(c)}" for name, c in parts)
            what = f"band {band}{' split' if split else ''}"
            line += f" | bwd {what}: {names} CTAs fill {total:.3f}"
            if add_steps is not None and config.fused:
                chained = ordered_adds_fill(config, seq, b, n, n, causal, cta_steps, add_steps)
                line += f", with the adds' turns {chained:.3f}"
                # high_spans_first's own grid (the split has its own order)
                high_first_here = high_first and not split
                if high_first_here:
                    high = dataclasses.replace(config, rotated_adds=True, high_spans_first=True)
                    up = ordered_adds_fill(high, seq, b, n, n, causal, cta_steps, add_steps)
                    line += f", high spans first {up:.3f}"
                if l2:
                    args = (seq, b, n, n, causal, head_dim, cta_steps, add_steps)
                    line += f", L2 fetches {l2_rereads(config, *args):.2f}x"
                    if high_first_here:
                        line += f" (high spans first {l2_rereads(high, *args):.2f}x)"
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--causal", default="false,true")
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    parser.add_argument("--span-band", default="1", help="the backward's bands of heads")
    parser.add_argument("--cta-steps", type=float, default=2.0, help="a CTA's fixed cost")
    parser.add_argument("--heads", default="", help="head counts (default: the grid's)")
    parser.add_argument(
        "--tokens", type=int, default=16384, help="tokens a batch (batch x seq; the grid's)"
    )
    parser.add_argument(
        "--add-steps",
        type=float,
        default=None,
        help="the fused backward's ordered dQ adds waited on, each this many steps",
    )
    parser.add_argument(
        "--high-spans-first",
        action="store_true",
        help="with --add-steps, the fused backward launched from the last key span down",
    )
    parser.add_argument(
        "--l2",
        action="store_true",
        help="with --add-steps, the fused backward's query-side HBM fetches over the "
        "compulsory through a 50 MiB least-recently-used L2",
    )
    args = parser.parse_args(argv)
    for h in (int(x) for x in args.head_dims.split(",")):
        for causal in (c == "true" for c in args.causal.split(",")):
            for seq in (int(x) for x in args.seqs.split(",")):
                bands = [int(x) for x in args.span_band.split(",")]
                for n in [int(x) for x in args.heads.split(",") if x] or [None]:
                    line = report(
                        h,
                        seq,
                        causal,
                        bands,
                        args.cta_steps,
                        n,
                        args.add_steps,
                        args.high_spans_first,
                        args.l2,
                        args.tokens,
                    )
                    print(line)


if __name__ == "__main__":
    main()
