"""The direct launch path (streamkl_gpu._core.launcher): the same kernel, the same arguments, in the
kernel's parameter order, and a new binding whenever a specialisation property changes.

The real path only runs on a GPU (the interpreter has no compiled kernels); here a stand-in
JIT function records what each path receives, so the bookkeeping is checked on CPU."""
from __future__ import annotations

import inspect

import pytest
import torch

from streamkl_gpu._core import launcher as _fast_launch


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Compiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class _FakeJIT:
    """Like a JITFunction: fn[grid](*args, **kw) binds, compiles once per key and launches."""
    arg_names = ["X", "n", "scale", "BLOCK", "FLAG"]
    params = [_Param("X"), _Param("n"), _Param("scale"), _Param("BLOCK"), _Param("FLAG", default=True)]

    def __init__(self):
        self.log, self.compiled = [], 0

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.log.append(("bound", grid, args, kw))
            self.compiled += 1
            return _Compiled(self.log)
        return call


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(_fast_launch, "enabled", lambda: True)
    monkeypatch.setattr(_fast_launch, "_raw_stream", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_fast_launch, "_KERNELS", {})


def test_second_launch_is_direct_with_arguments_in_parameter_order(direct):
    fn = _FakeJIT()
    x = torch.zeros(8)
    _fast_launch.launch(fn, (2, 3, 1), (x, 5, 0.5), {"BLOCK": 16}, 4, 2)
    _fast_launch.launch(fn, (7, 1, 1), (x, 5, 0.25), {"BLOCK": 16}, 4, 2)
    assert [e[0] for e in fn.log] == ["bound", "direct"]
    assert fn.log[0][3] == {"BLOCK": 16, "num_warps": 4, "num_stages": 2}
    args = fn.log[1][1]
    # grid, stream, function, metadata, launch metadata, enter hook, exit hook, then every parameter
    assert args[:6] == (7, 1, 1, 1234, "fn-handle", "meta")
    assert args[6:8] == (None, None)
    assert args[9:] == (x, 5, 0.25, 16, True)  # the constexpr and the default filled in, in order


@pytest.mark.parametrize("change", ["alignment", "int_one", "int_mod16", "dtype", "constexpr", "warps", "none"])
def test_a_changed_specialisation_binds_again(direct, change):
    fn = _FakeJIT()
    buf = torch.zeros(64)
    first = (buf[:8], 32, 1.0)
    _fast_launch.launch(fn, (1, 1, 1), first, {"BLOCK": 16}, 4, 2)
    args, kw, warps = first, {"BLOCK": 16}, 4
    if change == "alignment":
        args = (buf[1:9], 32, 1.0)  # 4-byte offset: not 16-byte aligned
    elif change == "int_one":
        args = (buf[:8], 1, 1.0)
    elif change == "int_mod16":
        args = (buf[:8], 33, 1.0)
    elif change == "dtype":
        args = (buf[:8].double(), 32, 1.0)
    elif change == "constexpr":
        kw = {"BLOCK": 32}
    elif change == "warps":
        warps = 8
    _fast_launch.launch(fn, (1, 1, 1), args, kw, warps, 2)
    expected = "direct" if change == "none" else "bound"
    assert fn.log[-1][0] == expected
    assert fn.compiled == (1 if change == "none" else 2)


class _ConstexprParam(_Param):
    is_constexpr = True


class _FakeJITHeadDim(_FakeJIT):
    """A kernel whose head dim ``D: tl.constexpr`` comes positionally, among the sizes (as the
    attention kernels take D1, D2)."""
    arg_names = ["X", "D", "BLOCK"]
    params = [_Param("X"), _ConstexprParam("D"), _Param("BLOCK")]


def test_a_positional_constexpr_is_keyed_by_its_value(direct):
    """D = 96 and D = 128 share every property ``_spec`` keys an integer on (not 1, multiples of
    16, int32), but Triton compiles each into its own kernel: the second head dim binds again
    instead of launching the first one's kernel (it would read and write 96 of 128 columns)."""
    fn = _FakeJITHeadDim()
    x = torch.zeros(8)
    _fast_launch.launch(fn, (1, 1, 1), (x, 96), {"BLOCK": 16}, 4, 2)
    _fast_launch.launch(fn, (1, 1, 1), (x, 96), {"BLOCK": 16}, 4, 2)
    _fast_launch.launch(fn, (1, 1, 1), (x, 128), {"BLOCK": 16}, 4, 2)
    assert [e[0] for e in fn.log] == ["bound", "direct", "bound"]
    assert fn.log[-1][2] == (x, 128)


def test_compiling_ahead_keys_a_positional_constexpr_by_its_value(direct):
    log = []
    fn = _FakeJITHeadDim()
    fn.warmup = lambda *args, grid, **kw: log.append(args[1])
    x = torch.zeros(8)

    def work():
        for head_dim in (96, 128, 96):
            _fast_launch.launch(fn, (1, 1, 1), (x, head_dim), {"BLOCK": 16}, 4, 2)

    _fast_launch.compile_ahead(work, None).join(timeout=30)
    assert sorted(log) == [96, 128]


def test_off_under_the_interpreter_and_by_variable(monkeypatch):
    assert not _fast_launch.enabled()  # the suite runs under TRITON_INTERPRET=1
    monkeypatch.setenv("STREAMKL_FAST_LAUNCH", "0")
    assert not _fast_launch.enabled()
    fn = _FakeJIT()
    _fast_launch.launch(fn, (1, 1, 1), (torch.zeros(4), 3, 1.0), {"BLOCK": 16}, 4, 2)
    _fast_launch.launch(fn, (1, 1, 1), (torch.zeros(4), 3, 1.0), {"BLOCK": 16}, 4, 2)
    assert [e[0] for e in fn.log] == ["bound", "bound"]


def test_a_caller_key_skips_deriving_specialisations_but_not_tensor_alignment(direct):
    fn = _FakeJIT()
    buf = torch.zeros(64)
    _fast_launch.launch(fn, (1, 1, 1), (buf[:8], 32, 1.0), {"BLOCK": 16}, 4, 2, key="plan-A", tensors=(buf[:8],))
    _fast_launch.launch(fn, (1, 1, 1), (buf[:8], 32, 2.0), {"BLOCK": 16}, 4, 2, key="plan-A", tensors=(buf[:8],))
    assert [e[0] for e in fn.log] == ["bound", "direct"]
    _fast_launch.launch(fn, (1, 1, 1), (buf[1:9], 32, 1.0), {"BLOCK": 16}, 4, 2, key="plan-A", tensors=(buf[1:9],))
    assert fn.log[-1][0] == "bound"  # misaligned tensor: a new binding even under the same plan key


def test_check_mode_catches_a_caller_key_that_hides_a_specialisation(direct, monkeypatch):
    monkeypatch.setattr(_fast_launch, "CHECK", True)
    fn = _FakeJIT()
    x = torch.zeros(8)
    _fast_launch.launch(fn, (1, 1, 1), (x, 32, 1.0), {"BLOCK": 16}, 4, 2, key="plan-B", tensors=(x,))
    _fast_launch.launch(fn, (1, 1, 1), (x, 32, 3.0), {"BLOCK": 16}, 4, 2, key="plan-B", tensors=(x,))  # floats: fine
    with pytest.raises(RuntimeError, match="two specialisations"):
        _fast_launch.launch(fn, (1, 1, 1), (x, 1, 1.0), {"BLOCK": 16}, 4, 2, key="plan-B", tensors=(x,))


def test_hook_detection_handles_hook_chains_and_plain_callables():
    class Chain:
        def __init__(self, calls):
            self.calls = calls
    assert not _fast_launch._hooked(None)
    assert not _fast_launch._hooked(Chain([]))  # triton >= 3.5: the chain is always there, empty
    assert _fast_launch._hooked(Chain([print]))
    assert _fast_launch._hooked(print)  # triton < 3.5: the hook itself or None


def test_per_call_keyword_arguments_are_put_in_their_parameter_slots(direct):
    fn = _FakeJIT()
    x = torch.zeros(8)
    # FLAG stands for a descriptor argument that changes per call
    _fast_launch.launch(fn, (1, 1, 1), (x, 32, 1.0), {"BLOCK": 16}, 4, 2, key="plan-C", tensors=(x,),
                        runtime={"FLAG": "desc-1"})
    assert fn.log[0][3]["FLAG"] == "desc-1"
    _fast_launch.launch(fn, (1, 1, 1), (x, 32, 1.0), {"BLOCK": 16}, 4, 2, key="plan-C", tensors=(x,),
                        runtime={"FLAG": "desc-2"})
    assert fn.log[-1][0] == "direct" and fn.log[-1][1][9:] == (x, 32, 1.0, 16, "desc-2")

def test_the_fast_environment_read_follows_os_environ(monkeypatch):
    from streamkl_gpu._core import runtime as _runtime
    monkeypatch.delenv("STREAMKL_TEST_ENV_READ", raising=False)
    assert _runtime.env("STREAMKL_TEST_ENV_READ", "unset") == "unset"
    monkeypatch.setenv("STREAMKL_TEST_ENV_READ", "0")
    assert _runtime.env("STREAMKL_TEST_ENV_READ") == "0"
    monkeypatch.setenv("STREAMKL_TEST_ENV_READ", "é1")
    assert _runtime.env("STREAMKL_TEST_ENV_READ") == "é1"
    monkeypatch.delenv("STREAMKL_TEST_ENV_READ")
    assert _runtime.env("STREAMKL_TEST_ENV_READ") is None


def test_a_thread_compiling_ahead_only_compiles_and_binds_nothing(direct, monkeypatch):
    """In a compile-ahead thread a launch goes to ``fn.warmup`` with the launch's arguments and
    keywords, launches nothing and keeps nothing; the calling thread's launches are unchanged."""
    import threading

    fn = _FakeJIT()
    fn.warmup = lambda *args, grid, **kw: fn.log.append(("warmup", grid, args, kw))
    x = torch.zeros(8)
    seen = []

    def ahead():
        _fast_launch._AHEAD.on = True
        try:
            seen.append(_fast_launch.compiling_ahead())
            seen.append(_fast_launch.launch(fn, (2, 1, 1), (x, 5, 0.5), {"BLOCK": 16}, 4, 2))
        finally:
            _fast_launch._AHEAD.on = False

    thread = threading.Thread(target=ahead)
    thread.start()
    thread.join()
    assert seen == [True, None]
    assert fn.log == [("warmup", (2, 1, 1), (x, 5, 0.5), {"BLOCK": 16, "num_warps": 4, "num_stages": 2})]
    assert _fast_launch._KERNELS == {} and not _fast_launch.compiling_ahead()
    _fast_launch.launch(fn, (2, 1, 1), (x, 5, 0.5), {"BLOCK": 16}, 4, 2)  # this thread: a real launch
    assert [e[0] for e in fn.log] == ["warmup", "bound"]


def test_compiling_ahead_compiles_each_kernel_on_its_own_thread_once(direct):
    """compile_ahead's work reaches two kernels and one of them twice: the two compile at the same
    time (each waits at a barrier for the other; one after the other, the barrier would break),
    the repeated launch compiles once, and the returned thread ends only after both compiles."""
    import threading
    import time

    both_started = threading.Barrier(2, timeout=10)
    log = []

    def fake(name):
        fn = _FakeJIT()

        def warmup(*args, grid, **kw):
            both_started.wait()
            time.sleep(0.05)
            log.append((name, threading.current_thread().name, args[1], kw["BLOCK"]))
        fn.warmup = warmup
        return fn

    dk, dq = fake("dk"), fake("dq")
    x = torch.zeros(8)

    def work():
        assert _fast_launch.launch(dk, (2, 1, 1), (x, 5, 0.5), {"BLOCK": 16}, 4, 2) is None
        _fast_launch.kernel_call(dq, (1, 1, 1))(x, 7, 0.5, BLOCK=32)
        _fast_launch.launch(dk, (2, 1, 1), (x, 5, 0.5), {"BLOCK": 16}, 4, 2)  # the same compile again

    thread = _fast_launch.compile_ahead(work, None)
    thread.join(timeout=30)
    assert not thread.is_alive() and not both_started.broken
    assert sorted(log) == [("dk", "streamkl-compile", 5, 16), ("dq", "streamkl-compile", 7, 32)]
    assert _fast_launch._KERNELS == {} and not _fast_launch.compiling_ahead()


def test_compiling_ahead_keys_runtime_arguments_by_their_specialisation(direct):
    """A chunk loop's launches differ only in an offset: offsets Triton specialises alike (0 and
    2048: both multiples of 16) compile once, an offset specialised otherwise (5) again."""
    log = []
    fn = _FakeJIT()
    fn.warmup = lambda *args, grid, **kw: log.append(args[1])
    x = torch.zeros(8)

    def work():
        for offset in (0, 2048, 5):
            _fast_launch.kernel_call(fn, (1, 1, 1))(x, offset, 0.5, BLOCK=32)

    _fast_launch.compile_ahead(work, None).join(timeout=30)
    assert sorted(log) == [0, 5]


def test_the_compiler_warm_up_runs_once_and_a_compile_joins_it(monkeypatch):
    """warm_compiler starts Triton's key and driver set-up on threads (on a GPU machine, outside
    the interpreter); compiler_ready joins them; a second warm_compiler starts nothing more."""
    import threading

    calls, release = [], threading.Event()

    def slow_key():
        release.wait(5)
        calls.append("key")

    monkeypatch.setattr(_fast_launch, "_compiler_key", slow_key)
    monkeypatch.setattr(_fast_launch, "ahead_allowed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_fast_launch, "_WARMUP", [])
    _fast_launch.warm_compiler()
    threads = list(_fast_launch._WARMUP)
    assert [t.name for t in threads] == ["streamkl-compiler-key", "streamkl-compiler-driver"]
    _fast_launch.warm_compiler()  # running already: nothing new
    assert _fast_launch._WARMUP == threads
    release.set()
    _fast_launch.compiler_ready()  # joins both (the driver's failure without a GPU is swallowed)
    assert calls == ["key"] and _fast_launch._WARMUP == [] and not any(t.is_alive() for t in threads)


def test_no_compiler_warm_up_without_a_gpu_or_when_compiling_ahead_is_off(monkeypatch):
    monkeypatch.setattr(_fast_launch, "_WARMUP", [])
    monkeypatch.setattr(_fast_launch, "interpreting", lambda: False)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fast_launch.warm_compiler()
    assert _fast_launch._WARMUP == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("STREAMKL_COMPILE_AHEAD", "0")
    _fast_launch.warm_compiler()
    assert _fast_launch._WARMUP == []
    monkeypatch.delenv("STREAMKL_COMPILE_AHEAD")
    monkeypatch.setattr(_fast_launch, "_compiler_key", lambda: None)
    _fast_launch.warm_compiler()  # the control: with a GPU and compiling ahead on, it starts
    assert len(_fast_launch._WARMUP) == 2
    _fast_launch.compiler_ready()


class _CLauncher36:
    """Triton 3.6's launcher object in form: ``__call__(self, gridX, gridY, gridZ, stream, function, *args)``
    that forwards the cooperative-grid and PDL flags and two scratch buffers to its C function."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, log, scratch=0):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, scratch, 0
        self.launch = lambda *args: log.append(("c", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.log.append(("object", (gridX, gridY, gridZ, stream, function) + args))


class _Compiled36:
    function, packed_metadata = "fn-handle", (4, 1, 0)

    def __init__(self, run):
        self.run = run


@pytest.mark.parametrize("version, scratch, form", [((3, 6), 0, "c"), ((3, 6), 256, "object"), ((3, 9), 0, "object")])
def test_direct_entry_calls_the_c_launcher_only_in_the_form_it_was_checked_on(monkeypatch, version, scratch, form):
    monkeypatch.setattr(_fast_launch, "_triton_minor", lambda: version)
    log = []
    run, head = _fast_launch.direct_entry(_Compiled36(_CLauncher36(log, scratch)))
    run(3, 2, 1, 99, *head, "X", 7)
    kind, args = log[-1]
    assert kind == form
    if form == "c":  # what 3.6's __call__ passes: flags, two scratch buffers, metadata, launch metadata, hooks
        assert args == (3, 2, 1, 99, "fn-handle", False, True, None, None, (4, 1, 0), None, None, None, "X", 7)
    else:  # the launcher object with the metadata, the launch metadata and the two hooks
        assert args == (3, 2, 1, 99, "fn-handle", (4, 1, 0), None, None, None, "X", 7)


def test_direct_entry_keeps_a_launcher_of_another_form(monkeypatch):
    monkeypatch.setattr(_fast_launch, "_triton_minor", lambda: _fast_launch.DIRECT_C_TRITON)

    class Named(_CLauncher36):  # 3.8 / 3.9: the metadata and hooks are named parameters
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            self.log.append(("object", (gridX,)))

    log = []
    run, head = _fast_launch.direct_entry(_Compiled36(Named(log)))
    assert head == ("fn-handle", (4, 1, 0), None, None, None)
    run(1, 1, 1, 0, *head)
    assert log[-1][0] == "object"
