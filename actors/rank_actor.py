"""`RankActor`: one rank of a replica, living in its placement-group bundle.

Two phases, as vLLM's Ray workers: a cheap constructor, then `setup()` after the driver has seen
where every actor landed and assigned ranks (torch.distributed init, named groups, plugin load).

Three lanes. Requests and collective_rpc calls reach a rank in one of three ways, never two for
one replica: over a Unix socket from the engine on the same node (`open_ipc`; this actor's request
thread reads and runs them in socket order); `execute` actor calls, run in the default concurrency
group on ONE dedicated execution thread in the order of the sequence numbers the driver gives them
(Ray does not promise execution order for async actors, so the actor restores it itself); or, with
a compiled graph, `run_compiled`, called by Ray's graph loop on the actor's own "_ray_system"
thread, in channel order. Liveness
pings and other control calls run in the "control" concurrency group, on an event loop of their
own, so they answer within the liveness interval however many calls wait in either lane.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from actors import ipc_codec, ipc_wire, peer
from actors.protocol import ERROR, MISSING, OK, ActorInfo, LaneRequest, RankReply, RankSpec
from phyai_ray.streams import ChunkSink
from phyai_ray.work import BATCH, CALL, STREAM

logger = logging.getLogger(__name__)

CONTROL = "control"
CONCURRENCY_GROUPS = {CONTROL: 4}


class RankActor:
    """A rank worker; made remote by `actors.rank_group` with placement and resource options."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phyai-rank")
        # control and stream threads start after setup (their first use needs the runner), and bind
        # the rank's CUDA device as the lanes' threads do (the current device is per thread)
        self._control_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phyai-rank-control",
                                                initializer=self._bind_device)
        self._stream_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="phyai-rank-stream",
                                               initializer=self._bind_device)
        self._streams: dict[int, ChunkSink] = {}  # seq -> chunks of a streamed request (output rank)
        self._latest_stream = -1  # the last stream that started here (streams start in seq order)
        self._next_seq = 0
        self._turn: asyncio.Condition | None = None
        self._runner: Any = None
        self._rank: int | None = None
        self._held = self._peak_held = 0  # execute calls this actor holds (arrived, not yet replied)
        self._lane_thread: bool | None = None

    def _bind_device(self) -> None:
        _bind_thread(self._runner)

    @ray.method(concurrency_group=CONTROL)
    async def info(self) -> ActorInfo:
        """Where this actor landed: node id and address, process id, Ray-assigned GPUs."""
        ctx = ray.get_runtime_context()
        return ActorInfo(node_id=ctx.get_node_id(), ip=ray.util.get_node_ip_address(), pid=os.getpid(),
                         gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
                         placement_group_id=ctx.get_placement_group_id())

    @ray.method(concurrency_group=CONTROL)
    async def free_port(self) -> int:
        """A TCP port free on this node right now (rank 0 hosts the rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    @ray.method(concurrency_group=CONTROL)
    async def ping(self) -> int:
        """Liveness, on the control lane: answers while a step runs and however many wait."""
        return os.getpid()

    @ray.method(concurrency_group=CONTROL)
    async def held(self) -> tuple[int, int]:
        """(execute calls held now, the most ever held at once): the dispatch bound seen from the rank."""
        return self._held, self._peak_held

    @ray.method(concurrency_group=CONTROL)
    async def control(self, op: str, args: tuple) -> Any:
        """A control operation (pause, sleep, weight update, ...) on the control lane's own thread.

        The driver stops dispatch and drains the execution thread first, so the plugin is idle.
        """
        if self._runner is None:
            raise RuntimeError(f"rank {self._rank} received control op {op!r} before setup finished")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._control_pool, self._runner.control, op, args)

    @ray.method(concurrency_group=CONTROL)
    async def read_stream(self, seq: int, max_items: int, timeout_s: float) -> tuple[list, bool]:
        """Chunks of streamed request `seq` (output rank); True once it finished and all were read."""
        sink = self._streams.get(seq)
        if sink is None:  # not started yet
            await asyncio.sleep(min(timeout_s, 0.02))
            return [], False
        loop = asyncio.get_running_loop()
        chunks, done = await loop.run_in_executor(self._stream_pool, sink.take, max_items, timeout_s)
        if done:
            self._streams.pop(seq, None)
        return chunks, done

    @ray.method(concurrency_group=CONTROL)
    async def open_ipc(self, engine_cuda: bool, engine_pid: int) -> tuple[str, bytes, bool, int]:
        """Listen for the engine's request socket: (address, token, whether this rank sees a GPU, pid).

        One client, process `engine_pid` (the kernel's record of the connecting process, checked
        by `actors.peer`); its requests run in order. CUDA results go to an engine that sees a GPU
        as CUDA IPC handles, else as CPU copies."""
        if self._runner is None:
            raise RuntimeError(f"rank {self._rank} was asked for a request socket before setup finished")
        listening, address, token = peer.listen()
        threading.Thread(target=self._serve_ipc, args=(listening, token, engine_cuda, engine_pid),
                         name="phyai-rank-ipc", daemon=True).start()
        return address, token, ipc_wire.cuda_visible(), os.getpid()

    def _serve_ipc(self, listening: socket.socket, token: bytes, engine_cuda: bool, engine_pid: int) -> None:
        """The request thread: read a request, run it, write the reply; ends when the engine closes the socket."""
        try:
            conn = peer.accept_engine(listening, token, engine_pid)
        except OSError as exc:
            logger.warning("rank %s: the engine did not connect its request socket: %s", self._rank, exc)
            return
        with conn:
            while True:
                try:
                    got = ipc_wire.recv_frame(conn)
                except (OSError, ConnectionError):
                    return
                if got is None:
                    return
                meta, body, fds = got
                seq, kind, reply_ranks, window = pickle.loads(meta)
                reply = self._run_lane(LaneRequest(seq, kind, None, reply_ranks, window),
                                       lambda: ipc_codec.decode(body, fds, private=True))
                ipc_codec.close_fds(fds)  # a request that failed before its payload was read: decode did not close them
                try:
                    encoded = ipc_codec.encode(reply, cuda_ipc=engine_cuda)
                except Exception as exc:  # the result does not pickle: the engine gets why
                    encoded = ipc_codec.encode(RankReply(seq, self._rank, ERROR, _portable(exc)))
                try:
                    ipc_wire.send_encoded(conn, b"", encoded)
                except OSError:
                    return

    @ray.method(concurrency_group=CONTROL)
    async def cancel_stream(self, seq: int) -> None:
        """The consumer stopped: the next emit returns False on every rank (also before it started);
        the buffer is forgotten once the stream has ended (nobody reads it any more). A cancel that
        arrives after the stream ended and was read changes nothing (no buffer is made again)."""
        sink = self._streams.get(seq)
        if sink is None:
            if seq <= self._latest_stream:  # it started here, and its buffer is already gone
                return
            sink = self._streams.setdefault(seq, ChunkSink())
        sink.cancel(then=lambda: self._streams.pop(seq, None))

    async def setup(self, spec: RankSpec) -> tuple[int, bool, bool]:
        """Join the replica's process groups and build the plugin model (on the execution thread);
        (pid, whether the model has step_batch, whether it has the iteration protocol)."""
        self._rank = spec.rank
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _setup_rank, self, spec)

    async def execute(self, seq: int, kind: str, payload: Any, reply_value: bool) -> RankReply:
        """Run request `seq` ("step" or "call") after every earlier one, on the execution thread."""
        self._held += 1
        self._peak_held = max(self._peak_held, self._held)
        try:
            turn = self._condition()
            async with turn:
                await turn.wait_for(lambda: self._next_seq == seq)
                job = asyncio.get_running_loop().run_in_executor(self._pool, self._run, seq, kind, payload)
                self._next_seq += 1
                turn.notify_all()
            value, status = await job
        finally:
            self._held -= 1
        return RankReply(seq, self._rank, status, value if reply_value or status == MISSING else None)

    def run_compiled(self, request: LaneRequest) -> RankReply:
        """One request of the replica's compiled graph, on the graph's thread (channel order is the order)."""

        def payload() -> Any:
            if isinstance(request.payload, ray.ObjectRef):  # a large request, put once by the driver
                return ray.get(request.payload)
            return request.payload
        return self._run_lane(request, payload)

    def _run_lane(self, request: LaneRequest, payload: Any) -> RankReply:
        """One request of a lane (socket or compiled graph), on the lane's thread, in lane order.

        Never raises: an exception goes back in the reply (status ERROR), so the driver names this
        rank and its cause, as a failed actor call would. `payload()` gives the request's payload.
        """
        if self._lane_thread is None:
            self._lane_thread = _bind_thread(self._runner)
        self._held = 1
        self._peak_held = max(self._peak_held, request.window)
        try:
            value, status = self._run(request.seq, request.kind, payload())
        except BaseException as exc:
            return RankReply(request.seq, self._rank, ERROR, _portable(exc))
        finally:
            self._held = 0
        wanted = self._rank in request.reply_ranks or status == MISSING
        return RankReply(request.seq, self._rank, status, value if wanted else None)

    def _condition(self) -> asyncio.Condition:
        if self._turn is None:
            self._turn = asyncio.Condition()
        return self._turn

    def _run(self, seq: int, kind: str, payload: Any) -> tuple[Any, str]:
        if self._runner is None:
            raise RuntimeError(f"rank {self._rank} received a {kind} before setup finished")
        if kind == BATCH:  # one step of several requests; exception items travel as values
            requests = [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in payload]
            out = self._runner.execute(BATCH, requests)
            return (None if out is None else [_portable(v) if isinstance(v, BaseException) else v for v in out]), OK
        if kind == STREAM:
            request, max_buffered = payload
            sink = None
            if self._runner.ctx.is_output_rank:
                sink = self._streams.setdefault(seq, ChunkSink(max_buffered))
            self._latest_stream = max(self._latest_stream, seq)  # after the sink: see cancel_stream
            return self._runner.execute(STREAM, request, sink), OK
        if kind == CALL:
            method = payload[0]
            if method.startswith("_") or not callable(getattr(self._runner.model, method, None)):
                return f"per-rank model {type(self._runner.model).__name__} has no public method {method!r}", MISSING
        return self._runner.execute(kind, payload), OK


def _setup_rank(actor: RankActor, spec: RankSpec) -> tuple[int, bool, bool]:
    import torch

    from phyai_ray.rank.runner import RankRunner, init_distributed, make_context
    from placement.topology import Topology

    topology = Topology.from_parallel(spec.parallel)
    device = torch.device("cpu")
    if spec.device_type == "cuda":
        device = torch.device("cuda", _cuda_index(spec))
        torch.cuda.set_device(device)
    elif spec.visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_device
    init = f"tcp://{spec.master_addr}:{spec.master_port}"
    groups = init_distributed(topology, spec.rank, device.type, init, spec.collective_timeout_s)
    groups.install()
    ctx = make_context(topology=topology, groups=groups, rank=spec.rank, replica_index=spec.replica_index,
                       device=device, dtype=getattr(torch, spec.params_dtype), parallel=spec.parallel,
                       node_id=ray.get_runtime_context().get_node_id())
    actor._runner = RankRunner(spec.entry, spec.plugin_args, ctx)
    return os.getpid(), actor._runner.batchable, actor._runner.iterative


def _cuda_index(spec: RankSpec) -> int:
    """Make this rank see the devices the engine sees and return the index of its own among them.

    On the engine's node every rank sees the launcher's devices, so `cuda:k` names the same GPU in
    the engine and in every rank (a CUDA tensor shared between them keeps its meaning); Ray's GPU
    accounting still gives each rank its own device. Elsewhere (or when the rank's device is not
    among the engine's) the rank sees only its own device, as `cuda:0`. Runs before CUDA starts.
    """
    assigned = [str(g) for g in ray.get_gpu_ids()]
    own = spec.visible_device or (assigned[0] if assigned else None)
    if own is None:
        return 0
    if spec.engine_node is not None and spec.engine_node == ray.get_runtime_context().get_node_id():
        launcher = [d.strip() for d in (spec.launcher_devices or "").split(",") if d.strip()]
        if spec.launcher_devices is None and own.isdigit():
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            return int(own)
        if own in launcher:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(launcher)
            return launcher.index(own)
    os.environ["CUDA_VISIBLE_DEVICES"] = own
    return 0


def _bind_thread(runner: Any) -> bool:
    """Prepare a lane's thread to run the plugin: the rank's CUDA device (set per thread); a blocking
    `ray.get` of a large compiled-graph request is fine there (it is not the actor's event loop)."""
    os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"  # read by ray.get at each call
    device = getattr(getattr(runner, "ctx", None), "device", None)
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.set_device(device)
    return True


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else a RuntimeError with its type and message (it must cross the channel)."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
