"""Raw machine primitives for shared-region access, emitted from Numba through llvmlite.

Why intrinsics and inline asm: the protocol code is jitted (a lookup batch is one call), so the
flushes, fences and un-hoistable loads must exist inside nopython code. Everything here takes an
integer *address* (``line_addr`` / ``word_addr``): the region base plus an offset in bytes.

* Loads and stores are LLVM ``monotonic`` atomics: single-copy atomic for aligned 64-bit words and
  never hoisted out of a spin loop or merged by the compiler (plain numpy indexing is hoisted: a
  spin loop on it never terminates).
* Cache-line flushes use inline asm, not the ``llvm.x86.clflushopt`` intrinsic: the intrinsic only
  compiles for a target with ``+clflushopt`` and hard-aborts a generic-CPU build. The instruction is
  chosen at run time from ``/proc/cpuinfo`` (an absent instruction would raise SIGILL).
* libc calls (``sched_yield``, ``usleep``, ``clock_gettime``) are declared by symbol name inside the
  intrinsic, so functions using them stay cacheable (ctypes pointers would disable ``cache=True``).

Warning: inline asm needs ``llvmlite.binding.initialize_native_asmparser()`` before the first
compile, or LLVM aborts the process with no Python exception. Importing this module does that.
"""
from __future__ import annotations

from typing import Any

from llvmlite import binding as _llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Without the asm parser an inline-asm compile aborts the whole process (no exception).
_llvm_binding.initialize_native_asmparser()

_i8p = ir.IntType(8).as_pointer()
_i64 = ir.IntType(64)
_i64p = _i64.as_pointer()
_i32 = ir.IntType(32)
_v4i64 = ir.VectorType(_i64, 4)


def _asm_void_addr(builder: ir.IRBuilder, template: str, addr_value: ir.Value) -> None:
    ptr = builder.inttoptr(addr_value, _i8p)
    builder.asm(ir.FunctionType(ir.VoidType(), [_i8p]), template, "r,~{memory}", [ptr],
                side_effect=True)


def _asm_void(builder: ir.IRBuilder, template: str) -> None:
    builder.asm(ir.FunctionType(ir.VoidType(), []), template, "~{memory}", [], side_effect=True)


@intrinsic
def aload64(typingctx, word_addr):
    """64-bit monotonic-atomic load from an absolute address (never hoisted, never torn)."""
    sig = types.uint64(word_addr)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _i64p)
        return builder.load_atomic(ptr, "monotonic", 8)
    return sig, codegen


@intrinsic
def astore64(typingctx, word_addr, value):
    """64-bit monotonic-atomic store to an absolute address (never merged or elided)."""
    sig = types.void(word_addr, value)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _i64p)
        val = context.cast(builder, args[1], signature.args[1], types.uint64)
        builder.store_atomic(val, ptr, "monotonic", 8)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def clflush_line(typingctx, line_addr):
    """``clflush``: write back (if dirty) and invalidate the line holding ``line_addr``."""
    sig = types.void(line_addr)

    def codegen(context, builder, signature, args):
        _asm_void_addr(builder, "clflush ($0)", args[0])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def clflushopt_line(typingctx, line_addr):
    """``clflushopt``: like clflush but weakly ordered (needs a fence after a batch)."""
    sig = types.void(line_addr)

    def codegen(context, builder, signature, args):
        _asm_void_addr(builder, "clflushopt ($0)", args[0])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def prefetch_line(typingctx, line_addr):
    """``prefetcht0``: start loading the line holding ``line_addr`` into every cache level. A
    hint only: no fault, no ordering, and no compiler barrier (no memory clobber)."""
    sig = types.void(line_addr)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _i8p)
        builder.asm(ir.FunctionType(ir.VoidType(), [_i8p]), "prefetcht0 ($0)", "r", [ptr],
                    side_effect=True)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def clwb_line(typingctx, line_addr):
    """``clwb``: write back the line, which may stay cached. Warning: never a reader invalidate."""
    sig = types.void(line_addr)

    def codegen(context, builder, signature, args):
        _asm_void_addr(builder, "clwb ($0)", args[0])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def sfence(typingctx):
    """``sfence``: earlier stores and flushes are ordered before later stores."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        _asm_void(builder, "sfence")
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def mfence(typingctx):
    """``mfence``: full fence; later loads cannot pass earlier stores or flushes."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        _asm_void(builder, "mfence")
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def cpu_pause(typingctx):
    """``pause``: spin-loop hint."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        _asm_void(builder, "pause")
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def nt_copy32(typingctx, dst_addr, src_addr):
    """Copy 32 bytes with a non-temporal (streaming) store.

    Warning: ``dst_addr`` must be 32-byte aligned; ``src_addr`` may be unaligned. Needs an
    ``sfence`` after the last one before anything that publishes the bytes.
    """
    sig = types.void(dst_addr, src_addr)

    def codegen(context, builder, signature, args):
        vptr_t = _v4i64.as_pointer()
        src = builder.inttoptr(args[1], vptr_t)
        dst = builder.inttoptr(args[0], vptr_t)
        val = builder.load(src, align=1)
        st = builder.store(val, dst, align=32)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_i32, 1)]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def ntstore64(typingctx, word_addr, value):
    """64-bit non-temporal store (``movnti``): goes to memory through a write-combining buffer,
    evicting any cached copy of the line first; no flush needed, but an ``sfence`` before
    anything that depends on it. An aligned 8-byte NT store is written whole (never torn);
    several NT stores to one line may reach memory in any order until the fence.
    """
    sig = types.void(word_addr, value)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _i64p)
        val = context.cast(builder, args[1], signature.args[1], types.uint64)
        st = builder.store(val, ptr, align=8)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_i32, 1)]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def copy32(typingctx, dst_addr, src_addr):
    """Copy 32 bytes with ordinary (cached) unaligned loads and stores."""
    sig = types.void(dst_addr, src_addr)

    def codegen(context, builder, signature, args):
        vptr_t = _v4i64.as_pointer()
        src = builder.inttoptr(args[1], vptr_t)
        dst = builder.inttoptr(args[0], vptr_t)
        builder.store(builder.load(src, align=1), dst, align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def load_u8(typingctx, byte_addr):
    """Plain one-byte load from an absolute address (for payload tails)."""
    sig = types.uint8(byte_addr)

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], _i8p))
    return sig, codegen


@intrinsic
def store_u8(typingctx, byte_addr, value):
    """Plain one-byte store to an absolute address (for payload tails)."""
    sig = types.void(byte_addr, value)

    def codegen(context, builder, signature, args):
        val = context.cast(builder, args[1], signature.args[1], types.uint8)
        builder.store(val, builder.inttoptr(args[0], _i8p))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def sched_yield(typingctx):
    """libc ``sched_yield()``: give the core away (the right wait on a 2-core machine)."""
    sig = types.int32()

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i32, []),
                                            "sched_yield")
        return builder.call(fn, [])
    return sig, codegen


@intrinsic
def usleep(typingctx, micros):
    """libc ``usleep(micros)``. Real resolution is the timer slack (50 us by default)."""
    sig = types.int32(micros)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_i32, [_i32]),
                                            "usleep")
        val = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.call(fn, [val])
    return sig, codegen


@intrinsic
def monotonic_ns(typingctx):
    """``clock_gettime(CLOCK_MONOTONIC)`` in ns: the clock of ``time.perf_counter_ns()``."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        ts_t = ir.LiteralStructType([_i64, _i64])
        ts = cgutils.alloca_once(builder, ts_t)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_i32, [_i32, ts_t.as_pointer()]), "clock_gettime")
        builder.call(fn, [ir.Constant(_i32, 1), ts])  # 1 == CLOCK_MONOTONIC on Linux
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, ir.Constant(_i64, 1_000_000_000)), nsec)
    return sig, codegen


@intrinsic
def realtime_ns(typingctx):
    """``clock_gettime(CLOCK_REALTIME)`` in ns: the clock of ``time.time_ns()`` (heartbeats)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        ts_t = ir.LiteralStructType([_i64, _i64])
        ts = cgutils.alloca_once(builder, ts_t)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_i32, [_i32, ts_t.as_pointer()]), "clock_gettime")
        builder.call(fn, [ir.Constant(_i32, 0), ts])  # 0 == CLOCK_REALTIME
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, ir.Constant(_i64, 1_000_000_000)), nsec)
    return sig, codegen



def _fd_call_codegen(name: str):  # noqa: ANN202
    """Codegen of a libc ``ssize_t name(int fd, void *buf, size_t nbytes)`` call, by symbol."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(_i64, [_i32, _i8p, _i64]), name)
        f = context.cast(builder, args[0], signature.args[0], types.int32)
        b = builder.inttoptr(context.cast(builder, args[1], signature.args[1], types.uint64),
                             _i8p)
        n = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.call(fn, [f, b, n])
    return codegen


@intrinsic
def fd_read(typingctx, fd, buf_addr, nbytes):
    """libc ``read(fd, buf, nbytes)``: blocks (GIL-free) until the descriptor has data. Returns
    the bytes read, or -1 (errno not reported: a caller retries or gives up by its own rule)."""
    return types.int64(fd, buf_addr, nbytes), _fd_call_codegen("read")


@intrinsic
def fd_write(typingctx, fd, buf_addr, nbytes):
    """libc ``write(fd, buf, nbytes)``. Returns the bytes written, or -1."""
    return types.int64(fd, buf_addr, nbytes), _fd_call_codegen("write")

@intrinsic
def fd_wait_readable(typingctx, fd, timeout_ms):
    """libc ``poll`` of one descriptor for input, for at most ``timeout_ms`` (a high-resolution
    timer: ``SO_RCVTIMEO`` on a socket rounds up to scheduler ticks, ~8 ms on the dev VM).
    Returns > 0 when readable, 0 at the timeout, -1 on an error (EINTR included)."""
    sig = types.int64(fd, timeout_ms)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_i32, [_i8p, _i64, _i32]), "poll")
        pfd = cgutils.alloca_once(builder, ir.ArrayType(_i32, 2))     # struct pollfd
        f = context.cast(builder, args[0], signature.args[0], types.int32)
        builder.store(f, builder.gep(pfd, [ir.Constant(_i32, 0), ir.Constant(_i32, 0)]))
        # events = POLLIN (1) in the low half of the second word, revents = 0 (little endian)
        builder.store(ir.Constant(_i32, 1),
                      builder.gep(pfd, [ir.Constant(_i32, 0), ir.Constant(_i32, 1)]))
        t = context.cast(builder, args[1], signature.args[1], types.int32)
        r = builder.call(fn, [builder.bitcast(pfd, _i8p), ir.Constant(_i64, 1), t])
        return builder.sext(r, _i64)
    return sig, codegen


def _address_as(item: Any, llptr: Any) -> Any:
    """The typing and code of an intrinsic that takes an integer address as an ``item*`` (the
    pointer intrinsics below differ only in ``item`` and its LLVM pointer type)."""
    def typed(addr: Any) -> Any:
        sig = types.CPointer(item)(addr)

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            v = context.cast(builder, args[0], signature.args[0], types.uint64)
            return builder.inttoptr(v, llptr)
        return sig, codegen
    return typed


@intrinsic
def int64_ptr(typingctx, addr):
    """The integer ``addr`` as an ``int64*`` (for ``numba.carray`` over memory given by address).

    Warning: nothing checks that ``addr`` points at live, aligned int64 memory."""
    return _address_as(types.int64, _i64p)(addr)


@intrinsic
def uint64_ptr(typingctx, addr):
    """The integer ``addr`` as a ``uint64*`` (``int64_ptr``'s twin, for key words).

    Warning: nothing checks that ``addr`` points at live, aligned uint64 memory."""
    return _address_as(types.uint64, _i64p)(addr)


@intrinsic
def bool_ptr(typingctx, addr):
    """The integer ``addr`` as a ``bool*`` (one byte each, as numpy's ``bool_`` arrays).

    Warning: nothing checks that ``addr`` points at live memory."""
    return _address_as(types.boolean, _i8p)(addr)
