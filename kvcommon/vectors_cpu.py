"""What the compiled loops' vector intrinsics (numba @intrinsic bodies written in LLVM IR: the
butterflies, the quantiser's counts and packing, vector_norm's and torch.sum's orders, the
metrics' energies) build their code from: a counted loop with values carried around it, a scalar
spread over a vector, and a vector loaded from or stored into an array at an element index.

An intrinsic writes out what LLVM's vectoriser does not find in numba's loops (vectors across a
row's elements, shuffles, a register carried across a loop) with each operation rounded once, so
the loops keep the bits of the torch passes they replace. A *_cpu module: imported only by the
compiled loops (llvmlite comes with numba).
"""
from __future__ import annotations

import contextlib
import functools
import platform
from dataclasses import dataclass, field

import llvmlite.ir as ir
from numba.core import cgutils, types


@dataclass
class Loop:
    """A counted loop under construction: `index` its counter; `carried` the values carried from
    one step to the next (their values at the step's start; after the loop, at its end); the body
    sets `next` to the values the step hands on, in the same order."""
    index: ir.Value
    carried: list = field(default_factory=list)
    next: list = field(default_factory=list)


@contextlib.contextmanager
def counted_loop(builder: ir.IRBuilder, count: ir.Value, step: int, carried=(), name: str = "loop"):
    """for index in range(0, count, step): the body is what the with-block builds (it gets a Loop);
    `carried` the initial values of the values carried around it. After the block the builder
    sits past the loop, where loop.carried hold the final values."""
    kind = count.type
    entry = builder.block
    head, body, done = (builder.append_basic_block(f"{name}.{part}") for part in ("head", "body", "done"))
    builder.branch(head)
    builder.position_at_end(head)
    index = builder.phi(kind)
    index.add_incoming(ir.Constant(kind, 0), entry)
    loop = Loop(index)
    for value in carried:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        loop.carried.append(phi)
    builder.cbranch(builder.icmp_signed("<", index, count), body, done)
    builder.position_at_end(body)
    yield loop
    end = builder.block
    index.add_incoming(builder.add(index, ir.Constant(kind, step)), end)
    for phi, value in zip(loop.carried, loop.next, strict=True):
        phi.add_incoming(value, end)
    builder.branch(head)
    builder.position_at_end(done)


def literal_sizes(length: types.Type, sizes) -> tuple:
    """The sizes by_size is to write code for, given the numba type of the row length it switches
    on: where that is a literal (a loop called through by_length), only the one it names (none if
    it is not among them): a run compiles the code of the row length it uses, not of all six
    (most of a first run's compiling: docs/performance.md); else every size."""
    if isinstance(length, types.IntegerLiteral):
        return tuple(size for size in sizes if size == length.literal_value)
    return tuple(sizes)


class by_length:
    """A compiled loop called with one integer argument, the row length, as a literal (numba's
    Literal[int]): compiled once per length the run uses, the intrinsics below it writing only
    that length's code (literal_sizes), and cached on disk like any other signature. The
    dispatcher would type the argument as int64 (and compile every length); numba.literally would
    make it literal but dispatches every call through the compiler (7 ms a call), so the entry
    point of each signature is kept here and called directly."""

    def __init__(self, loop, position: int):
        self.loop, self.position, self._entries = loop, position, {}

    def __call__(self, *args):
        typeof = self.loop.typeof_pyval
        signature = tuple(types.literal(int(value)) if k == self.position else typeof(value)
                          for k, value in enumerate(args))
        entry = self._entries.get(signature)
        if entry is None:
            entry = self._entries[signature] = self.loop.compile(signature)
        return entry(*args)


def by_size(builder: ir.IRBuilder, value: ir.Value, sizes, build, defaults=()) -> list:
    """IR: build(size) for the one of `sizes` that the integer `value` equals — code written for
    each size (a row held in registers as size/8 vectors), chosen by a switch at run time —
    and the values build returned (a list, of the same types for every size) merged after it;
    for any other value, none of it runs and the result is `defaults`."""
    done = builder.append_basic_block("size.done")
    switch = builder.switch(value, done)
    arrivals = [(builder.block, list(defaults))]
    for size in sizes:
        block = builder.append_basic_block(f"size.{size}")
        switch.add_case(ir.Constant(value.type, size), block)
        builder.position_at_end(block)
        out = list(build(size))
        arrivals.append((builder.block, out))
        builder.branch(done)
    builder.position_at_end(done)
    merged = []
    for k in range(len(defaults)):
        phi = builder.phi(defaults[k].type)
        for block, out in arrivals:
            phi.add_incoming(out[k], block)
        merged.append(phi)
    return merged


def splat(builder: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """A vector of `lanes` copies of the scalar value."""
    one = builder.insert_element(ir.Constant(ir.VectorType(value.type, lanes), ir.Undefined), value,
                                 ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def joined(builder: ir.IRBuilder, vectors: list) -> list:
    """Consecutive pairs of `vectors` (of 8 lanes; an even count) as vectors of 16: a, b -> a ‖ b."""
    order = ir.Constant(ir.VectorType(ir.IntType(32), 16), list(range(16)))
    return [builder.shuffle_vector(a, b, order) for a, b in zip(vectors[::2], vectors[1::2])]


def halved(builder: ir.IRBuilder, vectors: list) -> list:
    """Vectors of 16 lanes as twice as many of 8, each one's low half first (joined undone)."""
    halves = [ir.Constant(ir.VectorType(ir.IntType(32), 8), list(range(h, h + 8))) for h in (0, 8)]
    return [builder.shuffle_vector(v, v, half) for v in vectors for half in halves]


def vector_pointer(context, builder: ir.IRBuilder, array, index: ir.Value, vector: ir.VectorType) -> ir.Value:
    """A pointer to the vector of `vector`'s lanes starting at element `index` of the numba array
    struct `array` (contiguous)."""
    return builder.bitcast(builder.gep(array.data, [index]), vector.as_pointer())


def load_vector(context, builder: ir.IRBuilder, array, index: ir.Value, vector: ir.VectorType) -> ir.Value:
    """The vector of `vector`'s lanes starting at element `index` of `array` (aligned as one element)."""
    return builder.load(vector_pointer(context, builder, array, index, vector),
                        align=context.get_abi_sizeof(vector.element))


def store_vector(context, builder: ir.IRBuilder, value: ir.Value, array, index: ir.Value) -> None:
    """Store the vector `value` at element `index` of `array` onwards."""
    builder.store(value, vector_pointer(context, builder, array, index, value.type),
                  align=context.get_abi_sizeof(value.type.element))


@functools.lru_cache(maxsize=None)
def has_feature(name: str) -> bool:
    """Whether the CPU numba compiles for has the instruction-set feature `name` (e.g. "avx2"):
    NUMBA_CPU_FEATURES where set, else the host's, as numba's own code generation takes them."""
    from numba.core import config
    import llvmlite.binding
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvmlite.binding.get_host_cpu_features().flatten()
    return f"+{name}" in features.split(",")


def vector_registers(itemsize: int) -> int:
    """How many vectors of 8 elements of `itemsize` bytes the CPU's vector registers hold at once:
    each vector takes one register where it fits in one, else as many as it spans — 32 registers
    of 512 bits with AVX-512 (VL: the 256-bit vectors in all 32), 16 of 256 with AVX2 (x86 without
    AVX-512), 32 of 128 on AArch64. A loop that keeps more live vectors than this spills them to
    memory."""
    if has_feature("avx512vl"):
        count, bits = 32, 512
    elif platform.machine().lower() in ("aarch64", "arm64"):
        count, bits = 32, 128
    else:
        count, bits = 16, 256
    return count * bits // max(bits, 8 * 8 * itemsize)


def intrinsic_name(base: str, kind: ir.Type) -> str:
    """LLVM's name of the overloaded intrinsic `base` for the scalar or vector type kind, e.g.
    llvm.fma.v8f32 (llvmlite names scalar overloads only)."""
    element = kind.element if isinstance(kind, ir.VectorType) else kind
    suffix = {ir.FloatType: "f32", ir.DoubleType: "f64"}.get(type(element)) or f"i{element.width}"
    return f"{base}.v{kind.count}{suffix}" if isinstance(kind, ir.VectorType) else f"{base}.{suffix}"


def fused_multiply_add(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a·b + c rounded once, lane by lane (LLVM's fma: the CPU's instruction where it has one)."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3),
                                         intrinsic_name("llvm.fma", a.type))
    return builder.call(fma, [a, b, c])


def gather(builder: ir.IRBuilder, base: ir.Value, indices: ir.Value, kind: ir.Type, scale: int) -> ir.Value:
    """IR: the 8 values of type kind (float or i32) at byte offsets base + scale·indices[k] (8
    int32 indices), by AVX2's gather (callers check has_feature("avx2"))."""
    lanes = ir.VectorType(ir.IntType(32), 8)
    values = ir.VectorType(kind, 8)
    name = "llvm.x86.avx2.gather.d.ps.256" if isinstance(kind, ir.FloatType) else "llvm.x86.avx2.gather.d.d.256"
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        values, [values, ir.IntType(8).as_pointer(), lanes, values, ir.IntType(8)]), name)
    every = ir.Constant(lanes, [-1] * 8)
    mask = builder.bitcast(every, values) if isinstance(kind, ir.FloatType) else every
    return builder.call(function, [ir.Constant(values, None), builder.bitcast(base, ir.IntType(8).as_pointer()),
                                   indices, mask, ir.Constant(ir.IntType(8), scale)])


def lane_total(builder: ir.IRBuilder, vector: ir.Value, lanes: int) -> ir.Value:
    """Lane 0 + lane 1 + ... + the last lane, added in order, each sum rounded once."""
    total = builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))
    for j in range(1, lanes):
        total = builder.fadd(total, builder.extract_element(vector, ir.Constant(ir.IntType(32), j)))
    return total
