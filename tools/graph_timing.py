"""Time a body of GPU work as one CUDA graph (the way the decode step runs): warm it up on a side stream,
capture it once, replay it, and time replays with CUDA events. Shared by the launch-shape probes."""
from __future__ import annotations

from typing import Callable


def replay_us(body: Callable[[], object], reps: int = 20) -> tuple[float, object]:
    """(us per replay of the graph of body(), what body() returned during capture: its static outputs)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps, out
