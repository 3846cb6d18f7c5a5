// The Hopper forward kernel (sm90a).  The first thread of warp group 0 loads each tile's Q and
// its K, V key tile by key tile through a ring of shared-memory stages with TMA; each other warp
// group owns 64 query rows and computes S = Q K^T and O += P V with wgmma, the online softmax in
// registers between them.  Where the config says kPersistent, one block per SM takes (query
// tile, head, batch) tiles in turn; otherwise each block takes one tile.
//
// Note [Hopper forward pipeline]
// - Roles: warp group 0 is the producer (setmaxnreg down to kProducerRegs; one thread issues
//   every TMA); warp groups 1.. are consumers (setmaxnreg up to kConsumerRegs).
// - Tiles are taken in the order of common/tile_order.cuh (heaviest first under a causal mask).
//   Persistent, they are handed out dynamically: block b starts with tile b, and its producer
//   takes each next one from a tile counter in global memory (atomicAdd; the launcher zeroes
//   it) once the current tile's loads are issued, so that a block that drew light tiles takes
//   more.  The producer skips tiles past a packed sequence, writes the tile's index to shared
//   memory before it arrives on barrier_q, and -1 when none is left; the consumers read it after
//   their wait.  The K and V pipelines run on across tiles, so the next tile's first key tiles
//   load while this tile finishes.  With one tile per block, the grid is the tile order's, and a
//   block whose tile lies past its packed sequence leaves before any barrier.
// - Q arrives on barrier_q, one phase per tile (a tile with no visible key gets a plain arrive:
//   the consumers wait on every tile, which keeps them at most one tile ahead of the producer).
//   The producer loads the next Q only after barrier_q_free says every consumer is done with
//   Q's buffer: after its last S = Q K^T where O is staged outside it (its own buffer,
//   kSeparateO, or V's stages, kOInV), so that the next Q lands under the last P V and the
//   epilogue; after the epilogue where O is staged in Q's buffer (one block per tile).
// - kOInV (persistent head dim 256, whose shared memory holds no second buffer): O is staged in
//   V's stages once every consumer warp group's last P V has read them (a barrier of all
//   consumers), and each warp group's leader arrives on barrier_o_read once its O has left
//   them (its TMA store has read the slab, or its copy-out is done and all consumers synced).
//   The producer waits for that phase before the next tile's first V (the next Q and first K
//   go first), and for a tile without a visible key before its Q, so that the consumers never
//   run two epilogues ahead of its wait.
//   The tile's first K is issued before that wait: its stage is free as soon as this tile's
//   last S has read it (NOTES entry 50: +3-11% at seqlen 512-2k).
// - With kPrefetchQ, Q has two buffers, each with its barriers and tile index (the block's i-th
//   tile takes buffer i % 2).  The producer claims the next tile and issues its Q while it
//   loads the current tile's last kPrefetchQLead + 1 key tiles (at the first K of a tile with
//   fewer), so that the next Q lands before this tile's epilogue without waiting for this
//   tile's last S; claiming no earlier than that keeps a long tile from binding the next one to
//   its block long before the block can start it (the end of the schedule stays balanced).
// - K and V have a pipeline each (full barriers counting TMA bytes, empty barriers counting the
//   consumer threads), so that K of the next key tile can land while V of this one is read.
// - Key tiles are visited from the last to the first, so the masked ones of a partial last
//   tile and the causal diagonal come first; a tile is masked only where tile_all_visible says
//   it must be (so, with a left window bound, also the last ones visited).  The tiles a warp
//   group's rows see whole are one run, which takes a copy of the loop without the mask's code
//   where the config says kMaskFreeLoop.
// - With kPerWarpGroupKeys a warp group computes only on the key tiles its own 64 rows see (a
//   run inside the block's); on the others it waits for the stages and frees them, since the
//   pipelines' empty barriers count every consumer warp group, and it takes part in the first
//   V tile's zeroing.  A warp group that skips the block's first key tile takes its turn for
//   the first S at once (below), so that the turns never wait on a skipped tile.
// - Inside a warp group, iteration n issues S_n = Q K_n^T and O += P_{n+1} V_{n+1}, waits for
//   S_n only, runs the softmax of S_n, then waits for P V (and rescales O, unless
//   kRescaleUnderS: then O is rescaled between the next S and P V issues).  That is the order
//   of the source; ptxas moves the P V wait up to the row maximum's first shuffle (NOTES entry
//   54), so a warp group's softmax runs under the other warp groups' GEMMs, not its own P V.
// - With kPingPong the consumer warp groups also take turns, in a round: each issues its GEMMs
//   between a sync on its own scheduler barrier and an arrive on the next one's, so the GEMMs
//   of one run while the others do their softmax.  The last warp group grants the first turn,
//   and warp group 0 takes one more turn at the end so that every arrive is matched.  Nothing
//   inside a turn may wait for another warp group (the V-tail barrier below is taken outside
//   the turns).  Without kPingPong they take turns for a tile's first S only (NOTES entry 51).
// - Rows past a sequence's keys in the first (partial) V tile hold whatever follows in memory
//   (the next packed sequence, an unused cache slot): their P is exactly 0, but 0 * NaN is NaN,
//   so the consumers zero those rows of the stage once per tile, before its first P V wgmma
//   (rows past the tensor arrive as TMA's zeros: a dense K without seqused needs none).
// - The epilogue stages O by stmatrix (in its own buffer, in V's stages, or in Q's: each warp
//   group only ever read its own 64 rows of Q).  From its own buffer or V's stages, a dense O
//   leaves by one TMA store per warp group; from its own buffer the consumers do not wait for
//   it: the store's issuer waits for it to have read the buffer only before the next tile's O
//   is staged there, and before the block ends (from V's stages, at once: the next V waits).
//   Otherwise (packed sequences, whose tile would run into the next one; O in Q's buffer) the
//   warp group copies it out in 16-byte stores.  Rows past the sequence and head-dim padding
//   stay unwritten either way.
#pragma once

// wgmma shapes whose N is not a power of 2 (kBlockN = 80, 96, ...), before any CuTe header.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/launch_api.h"
#include "common/params.h"
#include "common/seqlen_info.cuh"
#include "common/tile_order.cuh"
#include "sm90/softmax.cuh"
#include "sm90/tile_config.h"

namespace flash_cuda::sm90 {

using namespace cute;

template <class Tag> struct CuteType;
template <> struct CuteType<flash_cuda::half_t> { using type = cutlass::half_t; };
template <> struct CuteType<flash_cuda::bfloat16_t> { using type = cutlass::bfloat16_t; };

// The widest swizzle whose atom (8 rows x 32, 64 or 128 bytes) tiles kCols 16-bit columns.
template <class T, int kCols> constexpr auto k_major_smem_atom() {
  if constexpr (kCols % 64 == 0) {
    return GMMA::Layout_K_SW128_Atom<T>{};
  } else if constexpr (kCols % 32 == 0) {
    return GMMA::Layout_K_SW64_Atom<T>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<T>{};
  }
}

// Named barriers, as CUTLASS's user ids (NamedBarrier adds its reserved count, 8, to them, so
// they never meet __syncthreads' barrier 0 or CUTLASS's own).
enum class FwdBarrier : uint32_t {
  kVTail = 0,       // all consumers: the zeroed rows of the first V tile are written
  kEpilogue0 = 1,   // + warp group (3 at most): its rows of O are staged in shared memory
  kSchedule0 = 4,   // + warp group: its turn to issue GEMMs (kPingPong; else a tile's first S)
  kVRead = 7,       // all consumers: every P V of the tile has read V (kOInV: O may be staged)
};

template <class ElementTag, int kHeadDim_, class Config_> struct FwdKernel {
  using Element = typename CuteType<ElementTag>::type;
  using Config = Config_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr int kConsumerWarpGroups = kBlockM / 64;
  static constexpr int kConsumerThreads = kConsumerWarpGroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  using Registers = RegisterSplit<kConsumerWarpGroups>;
  static_assert(kBlockM % 64 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0, "wgmma's shapes");
  static constexpr bool kPingPong = Config::kPingPong;
  static constexpr bool kPersistent = Config::kPersistent;
  // K and V read from a KV cache in place (CacheKeysConfig, Note [Keys in place]).
  static constexpr bool kCacheKeys = reads_cache_keys<Config>::value;
  // kPingPong's turns need every warp group on every key tile.
  static constexpr bool kPerWarpGroupKeys = Config::kPerWarpGroupKeys && !kPingPong;
  static constexpr bool kRescaleUnderS = Config::kRescaleUnderS;
  static constexpr bool kMaskFreeLoop = Config::kMaskFreeLoop;
  // Q in two buffers, the next tile's requested under this one (persistent only).
  static constexpr bool kPrefetchQ = Config::kPrefetchQ && kPersistent;
  static constexpr int kQBuffers = kPrefetchQ ? 2 : 1;

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, K) of S = Q K^T
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // (M, N, K) of O += P V
  using WarpGroups = Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>;  // each takes 64 rows
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), WarpGroups{}));
  // P from registers; V read transposed (its head dim, wgmma's N, is the contiguous one).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K,
                           GMMA::Major::MN>(),
      WarpGroups{}));

  using SmemAtom = decltype(k_major_smem_atom<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));  // K and V alike
  // V as (head dim, keys, stage): the same bytes, the B operand of P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch); a packed (varlen) tensor
  // is one batch of all rows.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)),
                                          GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      select<0, 2>(TileShapeQK{}), _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutKV{}), select<1, 2>(TileShapeQK{}),
                                       _1{}));
  // O's staging: each warp group's 64 rows in a slab of their own, which its TMA store reads
  // (a slab of Q's layout would interleave the warp groups' rows); where O is staged in Q's
  // buffer (no kSeparateO), Q's layout, since another warp group may still read its Q rows.
  using SmemLayoutOSlab = decltype(tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>>{}));
  using GmemTensorOut = decltype(make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)),
                                             GmemShape{}, GmemStride{}));
  using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, GmemTensorOut{}, SmemLayoutOSlab{},
                                      Shape<_64, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  using Buffer = cute::array_aligned<Element, cosize_v<SmemLayoutQ>>;  // Q's or O's
  static constexpr int kWorkInts = 13;  // sizeof(Work) / 4 (checked in run())
  struct Barriers {
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    // Per Q buffer: its tile's Q has landed; the buffer may take the next Q; its tile's index,
    // or -1: no tile left (written before barrier_q's arrive).
    cutlass::arch::ClusterTransactionBarrier barrier_q[kQBuffers];
    cutlass::arch::ClusterBarrier barrier_q_free[kQBuffers];
    int tile[kQBuffers];
    // Config::kSharedWork: the tile's Work as the producer decoded it, per Q buffer (written
    // before barrier_q's arrive, like `tile`).
    int work[Config::kSharedWork ? kQBuffers : 1][Config::kSharedWork ? kWorkInts : 1];
    // kOInV: every consumer warp group's O has left V's stages (one arrive per warp group).
    cutlass::arch::ClusterBarrier barrier_o_read;
  };
  // O gets its own staging buffer where shared memory holds one (Note [Hopper forward
  // pipeline]).
  static constexpr bool kSeparateO =
      kPersistent && sizeof(Buffer) * (kQBuffers + 1) +
                             sizeof(Element) * cosize_v<SmemLayoutKV> * 2 + sizeof(Barriers) +
                             1024 <=
                         kMaxSmemBytes;
  // Otherwise a persistent kernel stages O in V's stages, which hold it (head dims 192, 256):
  // Q's buffer is then free after the tile's last S, as with kSeparateO, and the producer loads
  // the next tile's first V only once the epilogue has read O out of them.
  static constexpr bool kOInV =
      kPersistent && !kSeparateO && cosize_v<SmemLayoutQ> <= cosize_v<SmemLayoutKV>;
  // O is staged in slabs of its own (not in Q's buffer), and Q's buffer is free after the last S.
  static constexpr bool kOSlabs = kSeparateO || kOInV;
  struct NoBuffer {};
  struct SharedStorage {
    alignas(1024) Buffer q[kQBuffers];  // the first also O's staging without kSeparateO
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    alignas(1024) std::conditional_t<kSeparateO, Buffer, NoBuffer> o;
    Barriers barriers;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  // (M, D) over the slabs: row m is row m % 64 of slab m / 64.
  using SmemLayoutO = std::conditional_t<
      kOSlabs,
      decltype(composition(
          tile_to_shape(SmemAtom{}, Shape<_64, Int<kHeadDim>, Int<kConsumerWarpGroups>>{}),
          Layout<Shape<Shape<_64, Int<kConsumerWarpGroups>>, Int<kHeadDim>>,
                 Stride<Stride<_1, Int<64 * kHeadDim>>, _64>>{})),
      SmemLayoutQ>;
  static_assert(kSmemBytes <= kMaxSmemBytes, "the tile fits an sm90 block");
  static_assert(!kPrefetchQ || kSeparateO, "a second Q buffer leaves O a buffer of its own");
  static_assert(!(kOInV && kPrefetchQ), "kOInV's wait sits before the tile's first V");
  static_assert(!(Config::kAlignLastTile && kPingPong),
                "the turns of kPingPong count every warp group, rows before the sequence too");
  static_assert(!Config::kAlignLastTile || kPersistent, "run() closes the round of first turns");
  static_assert(!Config::kSharedWork || kPersistent, "the producer hands out a persistent block's tiles");
  // A warp group before its sequence takes no key tile only with kPerWarpGroupKeys (without
  // it every warp group takes the block's, and the V tail's barrier counts them all).
  static_assert(!Config::kAlignLastTile || kPerWarpGroupKeys,
                "warp groups before the sequence need their own (empty) key range");
  // Staged in Q's buffer, a warp group's O would overwrite rows another one still reads as Q
  // (warp group g reads rows 64 (g - (-m0 / 64)) on).
  static_assert(!Config::kAlignLastTile || kOSlabs, "O is staged outside Q's buffer");
  static __device__ __forceinline__ Element* o_buffer(SharedStorage& storage) {
    if constexpr (kSeparateO) {
      return storage.o.data();
    } else if constexpr (kOInV) {
      return storage.v.data();
    } else {
      return storage.q[0].data();
    }
  }

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    TmaO tma_o;       // O's rows as Q's, with O's strides
    bool tma_store_o;  // O leaves by TMA (a dense O staged in its own buffer); else 16-byte stores
    GmemShape shape_q;
    GmemShape shape_k;
    FwdParams problem;  // outputs, sequences, mask, scale
    // The tiles in the order of common/tile_order.cuh: tile t is block t of a grid of
    // (tiles_x, tiles_y, batch) blocks, x fastest; total_tiles of them.
    int tiles_x, tiles_y, total_tiles;
    int* tile_counter;  // tiles handed out past the first gridDim.x; zero at launch
    // By tiles_x, tiles_y and heads_q / heads_kv, for Config::kFastDivide: a tile index into
    // (x, y, batch) and a head into its K / V head (exact for dividends in [0, 2^31), where the
    // launcher keeps every drawn tile index).
    cutlass::FastDivmod div_x, div_y, div_group;
  };

  // Rows [m0, m0 + rows) less those before the sequence (m0 < 0, Config::kAlignLastTile),
  // which see no key and belong to no one: the first row and the count that the mask's block
  // ranges take.
  static __device__ __forceinline__ void real_rows(int m0, int rows, int& first, int& count) {
    first = Config::kAlignLastTile ? max(m0, 0) : m0;
    count = m0 + rows - first;
  }

  // Where this block works: its tile and the key tiles its rows can see.
  struct Work {
    int m_block, head, head_kv, batch;
    SeqlenInfo sq, sk;
    int m0;  // the tile's first row in its sequence (negative: rows before it, kAlignLastTile)
    int n_begin, n_end;

    __device__ __forceinline__ Work(const Params& params, int t)
        : Work(params.problem, params.tiles_x, tile_at(params, t), params.div_group) {}
    static __device__ __forceinline__ BlockTile tile_at(const Params& params, int t) {
      if constexpr (Config::kFastDivide) {
        int yz, x, z, y;
        params.div_x(yz, x, t);
        params.div_y(z, y, yz);
        return block_tile(params.problem.block_shift, x, y, z);
      } else {
        return block_tile(params.problem.block_shift, t % params.tiles_x,
                          (t / params.tiles_x) % params.tiles_y,
                          t / params.tiles_x / params.tiles_y);
      }
    }
    __device__ __forceinline__ Work(const FwdParams& p, int tiles_x, BlockTile tile,
                                    const cutlass::FastDivmod& div_group)
        // Rank 0 is the last query tile: with a causal mask it sees the most keys.
        : m_block((tiles_x >> p.block_shift) - 1 - tile.rank),
          head(tile.head),
          head_kv(Config::kFastDivide ? div_group.div(tile.head)
                                      : tile.head / (p.heads_q / p.heads_kv)),
          batch(tile.batch),
          sq(p.seq_q, tile.batch),
          sk(p.seq_k, tile.batch),
          // kAlignLastTile, under a mask with a right bound: the tiles end within 64 rows of the
          // sequence's last row, so that a partial tile is the first one, whose rows see the
          // fewest keys, not the last, which would take the most key tiles for its few rows.
          // Whole warp groups' rows only (64): a warp group's rows lie all before the sequence
          // or all in it, and no TMA box starts before row 0.
          m0(m_block * kBlockM -
             (Config::kAlignLastTile && p.window_right >= 0
                  ? (kBlockM - 1 - (sq.extent + kBlockM - 1) % kBlockM) / 64 * 64
                  : 0)) {
      int first, count;
      real_rows(m0, kBlockM, first, count);
      mask(p).key_block_range(first, count, kBlockN, n_begin, n_end);
    }
    // Whether the tile's row `row` lies in the sequence (not past it, nor before it under
    // kAlignLastTile): the rows whose O and lse are written.
    __device__ __forceinline__ bool in_sequence(int row) const {
      return (!Config::kAlignLastTile || m0 + row >= 0) && m0 + row < sq.extent;
    }
    __device__ __forceinline__ MaskInfo mask(const FwdParams& p) const {
      return MaskInfo(sq.len, sk.len, p.window_left, p.window_right);
    }
  };

  // `issue_q` runs once the K load of key tile `q_at` is issued (the tile's first, n_end - 1,
  // without kPrefetchQ), at once for a tile without a visible key: it issues a Q (this tile's,
  // or with kPrefetchQ the next one's).  `before_v` runs between it and that key tile's V load,
  // and for a tile without a visible key before `issue_q` (kOInV: the wait for the previous
  // tile's O to leave V's stages; before this tile's Q, the consumers, which need no stage for
  // such a tile, cannot run one epilogue ahead of it).
  template <class IssueQ, class BeforeV>
  static __device__ void load(const Params& params, SharedStorage& storage, Pipeline& pipeline_k,
                              Pipeline& pipeline_v, const Work& w, PipelineState& write,
                              int q_at, IssueQ&& issue_q, BeforeV&& before_v);
  template <class IssueQ, class BeforeV>
  static __device__ void load_from_cache(const Params& params, SharedStorage& storage,
                                         Pipeline& pipeline_k, Pipeline& pipeline_v,
                                         const Work& w, PipelineState& write, int q_at,
                                         IssueQ&& issue_q, BeforeV&& before_v);
  // w's Q into buffer b, on its barrier (a plain arrive for a tile without a visible key).
  static __device__ void load_q(const Params& params, SharedStorage& storage, const Work& w,
                                int b);
  // One tile, its Q in buffer b.
  static __device__ void consume(const Params& params, SharedStorage& storage,
                                 Pipeline& pipeline_k, Pipeline& pipeline_v, const Work& w,
                                 int b, PipelineState& read_k, PipelineState& read_v);
  template <class TensorO, class TensorLse>
  static __device__ void epilogue(const Params& params, SharedStorage& storage, const Work& w,
                                  TensorO& o, TensorLse& lse);

  static __device__ void run(const Params& params, SharedStorage& storage) {
    if constexpr (!kPersistent) {
      // A tile past its packed sequence: the whole block leaves before any barrier.
      const Work w(params.problem, params.tiles_x, block_tile(params.problem.block_shift),
                   params.div_group);
      if (w.m0 >= w.sq.extent) return;
    }
    const int warp_group = threadIdx.x / 128;
    Barriers& bars = storage.barriers;
    typename Pipeline::Params pipeline_params;
    pipeline_params.transaction_bytes = kKVBytes;
    pipeline_params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer
                                           : Pipeline::ThreadCategory::Consumer;
    pipeline_params.is_leader = threadIdx.x == 0;  // the thread that issues the TMA loads
    pipeline_params.num_consumers = kConsumerThreads;
    // Warp 0 initialises the barriers (fenced by the constructor; seen after the block sync).
    Pipeline pipeline_k(bars.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
    Pipeline pipeline_v(bars.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
    if (threadIdx.x == 0) {
      for (int b = 0; b < kQBuffers; ++b) {
        bars.barrier_q[b].init(1);
        bars.barrier_q_free[b].init(kConsumerThreads);
      }
      if constexpr (kOInV) bars.barrier_o_read.init(kConsumerWarpGroups);
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    if constexpr (!kPersistent) {
      // One tile per block: the block of the grid's (x, y, z) takes that tile.
      const Work w(params.problem, params.tiles_x, block_tile(params.problem.block_shift),
                   params.div_group);
      if (warp_group == 0) {
        cutlass::arch::warpgroup_reg_dealloc<Registers::kProducerRegs>();
        if (threadIdx.x == 0) {
          PipelineState write = cutlass::make_producer_start_state<Pipeline>();
          load(params, storage, pipeline_k, pipeline_v, w, write, w.n_end - 1,
               [&] { load_q(params, storage, w, 0); }, [] {});
        }
      } else {
        cutlass::arch::warpgroup_reg_alloc<Registers::kConsumerRegs>();
        PipelineState read_k, read_v;
        bars.barrier_q[0].wait(0);
        consume(params, storage, pipeline_k, pipeline_v, w, 0, read_k, read_v);
      }
      return;
    }
    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Registers::kProducerRegs>();
      if (threadIdx.x != 0) return;
      prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
      prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
      prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
      PipelineState write = cutlass::make_producer_start_state<Pipeline>();
      auto next_tile = [&] { return atomicAdd(params.tile_counter, 1) + int(gridDim.x); };
      // The first tile from t on that does not lie past its packed sequence, or -1.
      auto claim = [&](int t) {
        for (; t < params.total_tiles; t = next_tile()) {
          const Work w(params, t);
          if (w.m0 < w.sq.extent) return t;
        }
        return -1;
      };
      int issued = 0;  // tiles (and the end mark) whose Q this block has issued
      // Tile t (or the end mark, -1) into the next Q buffer, once the consumers are done with
      // that buffer: its index, then its Q.
      auto issue_q = [&](int t) {
        const int b = issued % kQBuffers;
        if (issued >= kQBuffers) {
          bars.barrier_q_free[b].wait(((issued - kQBuffers) / kQBuffers) & 1);
        }
        bars.tile[b] = t;
        if (t < 0) {
          bars.barrier_q[b].arrive();
        } else if constexpr (Config::kSharedWork) {
          // The consumers read the tile's Work as decoded here rather than decoding it again
          // on their path to the tile's first S; load_q's arrive releases the writes.
          const Work w(params, t);
          *reinterpret_cast<Work*>(bars.work[b]) = w;
          load_q(params, storage, w, b);
        } else {
          load_q(params, storage, Work(params, t), b);
        }
        ++issued;
      };
      int t = claim(blockIdx.x);
      int loaded = 0;  // tiles whose loads this block has issued
      if constexpr (kPrefetchQ) issue_q(t);
      while (t >= 0) {
        const Work w(params, t);
        int next = -1;
        if constexpr (kPrefetchQ) {
          load(params, storage, pipeline_k, pipeline_v, w, write,
               min(w.n_end - 1, w.n_begin + Config::kPrefetchQLead), [&] {
                 next = claim(next_tile());
                 issue_q(next);
               }, [] {});
        } else {
          // kOInV: the previous tile's O has left V's stages (barrier_o_read's phase i is the
          // block's i-th tile).
          auto wait_o_read = [&] {
            if constexpr (kOInV) {
              if (loaded > 0) bars.barrier_o_read.wait((loaded - 1) & 1);
            }
          };
          load(params, storage, pipeline_k, pipeline_v, w, write, w.n_end - 1,
               [&] { issue_q(t); }, wait_o_read);
          ++loaded;
          // Claimed only now, while the consumers still work through the stages in flight: a
          // tile claimed before this one's loads would be bound to this block a whole tile
          // early, which unbalances the end of a causal schedule.
          next = claim(next_tile());
        }
        t = next;
      }
      if constexpr (!kPrefetchQ) issue_q(-1);
    } else {
      cutlass::arch::warpgroup_reg_alloc<Registers::kConsumerRegs>();
      PipelineState read_k, read_v;
      // The closed round of first turns (see consume()): the last warp group grants warp group 0
      // its first, and warp group 0 takes the last warp group's last.
      constexpr bool kRound = kPersistent && !kPingPong;
      if (kRound && warp_group == kConsumerWarpGroups) {
        cutlass::arch::NamedBarrier::arrive(256, uint32_t(FwdBarrier::kSchedule0));
      }
      for (int taken = 0;; ++taken) {
        // The same in every lane, through a shuffle: Q's descriptors derive from it (see wg in
        // consume()).
        const int b = kQBuffers == 1 ? 0 : __shfl_sync(0xffffffff, taken % kQBuffers, 0);
        bars.barrier_q[b].wait((taken / kQBuffers) & 1);
        const int t = *static_cast<volatile int*>(&bars.tile[b]);
        if (t < 0) break;
        if constexpr (Config::kSharedWork) {
          static_assert(sizeof(Work) == kWorkInts * sizeof(int), "Work fits its shared slot");
          // The barrier's wait (an asm without a memory clobber) must not be passed by the
          // loads of the Work the producer wrote before its arrive.
          asm volatile("" ::: "memory");
          const Work w = *reinterpret_cast<const Work*>(bars.work[b]);
          consume(params, storage, pipeline_k, pipeline_v, w, b, read_k, read_v);
        } else {
          consume(params, storage, pipeline_k, pipeline_v, Work(params, t), b, read_k, read_v);
        }
      }
      if (kRound && warp_group == 1) {
        cutlass::arch::NamedBarrier::sync(256, uint32_t(FwdBarrier::kSchedule0));
      }
      // Shared memory must outlive the TMA stores that read it.
      if (threadIdx.x % 128 == 0) tma_store_wait<0>();
    }
  }
};

// One wgmma GEMM over the K mode of the operands, issued and committed, not waited for.
// kZeroInit: C = A B rather than C += A B.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, TensorA& a, const TensorB& b,
                                           TensorC& c) {
  // A from shared memory is a tensor of wgmma descriptors, from registers one of elements.
  constexpr bool kRegistersA = !is_same_v<typename TensorA::iterator, GMMA::DescriptorIterator>;
  // Fences keep the compiler from moving register reads / writes of the operands across the
  // asynchronous wgmma.
  if constexpr (kRegistersA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegistersA) warpgroup_fence_operand(a);
}

template <class ElementTag, int kHeadDim, class Config>
template <class IssueQ, class BeforeV>
__device__ void FwdKernel<ElementTag, kHeadDim, Config>::load(
    const Params& params, SharedStorage& storage, Pipeline& pipeline_k, Pipeline& pipeline_v,
    const Work& w, PipelineState& write, int q_at, IssueQ&& issue_q, BeforeV&& before_v) {
  if (w.n_begin >= w.n_end) {  // no key to see: the consumers write zeros
    before_v();
    issue_q();
    return;
  }
  if constexpr (kCacheKeys) {
    load_from_cache(params, storage, pipeline_k, pipeline_v, w, write, q_at, issue_q, before_v);
    return;
  }
  const FwdParams& p = params.problem;
  const bool varlen_k = p.seq_k.cu_seqlens != nullptr;
  Tensor mK = params.tma_k.get_tma_tensor(params.shape_k);  // (rows, d, heads, batch)
  Tensor mV = params.tma_v.get_tma_tensor(params.shape_k);
  Tensor gK = local_tile(domain_offset(make_coord(w.sk.offset, _0{}),
                                       mK(_, _, w.head_kv, varlen_k ? 0 : w.batch)),
                         select<1, 2>(TileShapeQK{}), make_coord(_, _0{}));  // (N, D, n)
  Tensor gV = local_tile(domain_offset(make_coord(w.sk.offset, _0{}),
                                       mV(_, _, w.head_kv, varlen_k ? 0 : w.batch)),
                         select<1, 2>(TileShapeQK{}), make_coord(_, _0{}));  // (N, D, n)
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), SmemLayoutKV{});  // (N, D, stage)
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), SmemLayoutKV{});  // (N, D, stage)
  // Plain variables, not structured bindings: the lambdas below capture them.
  auto tK = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                          group_modes<0, 2>(gK));
  auto tV = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                          group_modes<0, 2>(gV));
  Tensor tKgK = get<0>(tK);
  Tensor tKsK = get<1>(tK);
  Tensor tVgV = get<0>(tV);
  Tensor tVsV = get<1>(tV);

  // Rows and columns outside the tensor arrive as zeros (TMA's bounds); rows of the next
  // packed sequence arrive as they are and are masked (Note [Hopper forward pipeline]).
  // The first K goes first: its stage is free before Q's buffer is.
  // Each waits until the consumers released the stage, then arms its full barrier with the
  // bytes.
  auto load_k = [&](int n) {
    pipeline_k.producer_acquire(write);
    copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write), 0), tKgK(_, n),
         tKsK(_, write.index()));
  };
  auto load_v = [&](int n) {
    pipeline_v.producer_acquire(write);
    copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write), 0), tVgV(_, n),
         tVsV(_, write.index()));
    ++write;
  };
  // The key tiles before q_at, q_at with the Q issue between its K and V, then the rest: the
  // loops themselves carry no test for the Q.
  // Not unrolled: unrolled, the producer's copies of the loops cost the kernel spills (472 /
  // 500 bytes at head dim 128).
  int n = w.n_end - 1;
#pragma unroll 1
  for (; n > q_at; --n) {
    load_k(n);
    load_v(n);
  }
  load_k(n);
  issue_q();
  before_v();
  load_v(n);
#pragma unroll 1
  for (--n; n >= w.n_begin; --n) {
    load_k(n);
    load_v(n);
  }
}

// load() of the kernel that reads a KV cache in place (Note [Keys in place] in
// sm90/launch_fwd_kvcache.cuh): K / V tiles in the cache row cache_batch_idx picks, or in the
// page a sequence's page table names; a dense cache (or dense rows) as load() reads them.
template <class ElementTag, int kHeadDim, class Config>
template <class IssueQ, class BeforeV>
__device__ void FwdKernel<ElementTag, kHeadDim, Config>::load_from_cache(
    const Params& params, SharedStorage& storage, Pipeline& pipeline_k, Pipeline& pipeline_v,
    const Work& w, PipelineState& write, int q_at, IssueQ&& issue_q, BeforeV&& before_v) {
  const FwdParams& p = params.problem;
  const KvCacheArgs& kv = p.kv;
  const bool varlen_k = p.seq_k.cu_seqlens != nullptr;
  // K / V of a KV cache read in place (Note [Keys in place]): a cache row of their own
  // (cache_batch_idx), or pages of whole key tiles, the tensor's batch then a page.
  const int k_batch = kv.batch_idx != nullptr
                          ? min(max(kv.batch_idx[w.batch], 0), kv.cache_dim0 - 1)
                          : (varlen_k ? 0 : w.batch);
  Tensor mK = params.tma_k.get_tma_tensor(params.shape_k);  // (rows, d, heads, batch)
  Tensor mV = params.tma_v.get_tma_tensor(params.shape_k);
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), SmemLayoutKV{});  // (N, D, stage)
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), SmemLayoutKV{});  // (N, D, stage)
  // K's (or V's) (N, D) tiles in rows of `batch` (a sequence, a cache row or a page) and the
  // stages, partitioned for TMA: (copy, tile) and (copy, stage).
  auto partition = [&](const auto& tma, const auto& m, const auto& smem, int batch) {
    Tensor g = local_tile(domain_offset(make_coord(w.sk.offset, _0{}), m(_, _, w.head_kv, batch)),
                          select<1, 2>(TileShapeQK{}), make_coord(_, _0{}));  // (N, D, n)
    return tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(smem), group_modes<0, 2>(g));
  };
  auto k_part = [&](int batch) { return partition(params.tma_k, mK, sK, batch); };
  auto v_part = [&](int batch) { return partition(params.tma_v, mV, sV, batch); };
  // Plain variables, not structured bindings: the lambdas below capture them.
  auto tK = k_part(k_batch);
  auto tV = v_part(k_batch);
  Tensor tKgK = get<0>(tK);
  Tensor tKsK = get<1>(tK);
  Tensor tVgV = get<0>(tV);
  Tensor tVsV = get<1>(tV);
  // Rows and columns outside the tensor arrive as zeros (TMA's bounds); rows of the next
  // packed sequence arrive as they are and are masked (Note [Hopper forward pipeline]).
  // The first K goes first: its stage is free before Q's buffer is.
  // Each waits until the consumers released the stage, then arms its full barrier with the
  // bytes.  `where(n)` finds key tile n (its page, read before the wait for a free stage) and
  // `at(where(n), n)` gives its K and V source tiles.
  auto loads = [&](auto&& where, auto&& at) {
    auto load_k = [&](int place, int n) {
      pipeline_k.producer_acquire(write);
      copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write), 0), get<0>(at(place, n)),
           tKsK(_, write.index()));
    };
    auto load_v = [&](int place, int n) {
      pipeline_v.producer_acquire(write);
      copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write), 0), get<1>(at(place, n)),
           tVsV(_, write.index()));
      ++write;
    };
    // The key tiles before q_at, q_at with the Q issue between its K and V, then the rest:
    // the loops themselves carry no test for the Q.
    // Not unrolled: unrolled, the producer's copies of the loops cost the kernel spills (472 /
    // 500 bytes at head dim 128).
    int n = w.n_end - 1;
#pragma unroll 1
    for (; n > q_at; --n) {
      const int place = where(n);
      load_k(place, n);
      load_v(place, n);
    }
    const int place = where(n);
    load_k(place, n);
    issue_q();
    before_v();
    load_v(place, n);
#pragma unroll 1
    for (--n; n >= w.n_begin; --n) {
      const int place = where(n);
      load_k(place, n);
      load_v(place, n);
    }
  };
  if constexpr (pages_in_place(kBlockN)) {
    if (kv.page_table != nullptr) {
      // Key tile n is tile n mod page_tiles of page page_table[b][n / page_tiles].
      const int page_tiles = max(kv.page_size / kBlockN, 1);
      const int* page_row = kv.page_table + int64_t(w.batch) * kv.pages_per_seq;
      loads(
          [&](int n) {
            return min(max(page_row[min(n / page_tiles, kv.pages_per_seq - 1)], 0),
                       kv.cache_dim0 - 1);
          },
          [&](int page, int n) {
            return make_tuple(get<0>(k_part(page))(_, n % page_tiles),
                              get<0>(v_part(page))(_, n % page_tiles));
          });
      return;
    }
  }
  loads([](int) { return 0; },
        [&](int, int n) { return make_tuple(tKgK(_, n), tVgV(_, n)); });
}

template <class ElementTag, int kHeadDim, class Config>
__device__ void FwdKernel<ElementTag, kHeadDim, Config>::load_q(const Params& params,
                                                                SharedStorage& storage,
                                                                const Work& w, int b) {
  auto& barrier = storage.barriers.barrier_q[b];
  if (w.n_begin >= w.n_end) {
    barrier.arrive();
    return;
  }
  const bool varlen_q = params.problem.seq_q.cu_seqlens != nullptr;
  Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q);  // (rows, d, heads, batch)
  // A tile that starts before the sequence (m0 < 0, kAlignLastTile) loads from its row 0: its
  // warp group wg reads the Q rows of warp group wg - (-m0 / 64) (see consume()).  Without the
  // flag the tile is addressed as before: the same coordinates through m0 changed the SASS.
  Tensor gQ = [&] {  // (M, D)
    if constexpr (Config::kAlignLastTile) {
      return local_tile(domain_offset(make_coord(w.sq.offset + max(w.m0, 0), _0{}),
                                      mQ(_, _, w.head, varlen_q ? 0 : w.batch)),
                        select<0, 2>(TileShapeQK{}), make_coord(_0{}, _0{}));
    } else {
      return local_tile(domain_offset(make_coord(w.sq.offset, _0{}),
                                      mQ(_, _, w.head, varlen_q ? 0 : w.batch)),
                        select<0, 2>(TileShapeQK{}), make_coord(w.m_block, _0{}));
    }
  }();
  Tensor sQ = make_tensor(make_smem_ptr(storage.q[b].data()), SmemLayoutQ{});  // (M, D)
  auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                    group_modes<0, 2>(gQ));
  barrier.arrive_and_expect_tx(kQBytes);
  copy(params.tma_q.with(reinterpret_cast<uint64_t&>(barrier), 0), tQgQ, tQsQ);
}

template <class ElementTag, int kHeadDim, class Config>
__device__ void FwdKernel<ElementTag, kHeadDim, Config>::consume(const Params& params,
                                                                 SharedStorage& storage,
                                                                 Pipeline& pipeline_k,
                                                                 Pipeline& pipeline_v,
                                                                 const Work& w, int b,
                                                                 PipelineState& read_k,
                                                                 PipelineState& read_v) {
  const FwdParams& p = params.problem;
  auto& q_free = storage.barriers.barrier_q_free[b];  // arrived on once Q's buffer is read
  const int tid = threadIdx.x - 128;  // among the consumers
  const int m0 = w.m0;
  // This thread's warp group, through a shuffle from lane 0 so that ptxas sees it is the same in
  // every lane: what derives from it (the operands' wgmma descriptors, the warp group's key
  // range and so the pipeline stages it reads) then lives in uniform registers, as wgmma takes
  // its descriptors.  From `tid / 128` itself, Q's descriptors (and at head dim 64 the stage
  // addresses) sat in vector registers, and every wgmma of the key loop waited for R2UR copies
  // (NOTES entry 56).
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const int wg_m0 = m0 + wg * 64;  // this warp group's first row
  const MaskInfo mask = w.mask(p);
  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);  // per thread: the accumulators' elements
  // Per warp group: the operands' descriptors, sliced by the warp group's first thread.
  const auto wg_first_thread =
      make_layout(make_shape(Int<kConsumerWarpGroups>{}), make_stride(_128{}));
  auto wg_qk = mma_qk.get_slice(wg_first_thread(wg));
  auto wg_pv = mma_pv.get_slice(wg_first_thread(wg));
  // The warp group whose rows of Q's buffer this one reads: itself, but in a tile that starts
  // before its sequence (kAlignLastTile) the buffer holds the tile's rows from row 0 of the
  // sequence on, -m0 / 64 warp groups down (the warp groups before the sequence read none).
  auto wg_q = [&] {
    if constexpr (Config::kAlignLastTile) {
      return mma_qk.get_slice(
          wg_first_thread(__shfl_sync(0xffffffff, max(wg + min(m0, 0) / 64, 0), 0)));
    } else {
      return wg_qk;
    }
  }();
  Tensor sQ = make_tensor(make_smem_ptr(storage.q[b].data()), SmemLayoutQ{});  // (M, D)
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), SmemLayoutKV{});  // (N, D, stage)
  Tensor sVt = make_tensor(make_smem_ptr(storage.v.data()), SmemLayoutVt{});  // (D, N, stage)
  Tensor tSrQ = wg_q.partition_fragment_A(sQ);    // descriptors (MMA, MMA_M, MMA_K)
  Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(TileShapeQK{}));  // fp32 S
  Tensor tOrO = partition_fragment_C(mma_pv, select<0, 1>(TileShapePV{}));  // fp32 O
  Tensor tOrP = make_tensor<Element>(accumulator_as_a(tSrS.layout()));      // P, the A of P V
  Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));  // (rows, columns) views
  Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  // The (row, key) of each S element within the tile.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(select<0, 1>(TileShapeQK{})));
  Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;
  OnlineSoftmax<kRows> softmax(p.softmax_scale * float(M_LOG2E));
  clear(tOrO);

  // Masked scores are -inf (NaN and garbage of keys past the sequence included).
  auto apply_mask = [&](int n_block) {
    const int n0 = n_block * kBlockN;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      int lo, hi;
      mask.visible_keys(m0 + get<0>(cS(r, 0)), lo, hi);
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c) {
        const int j = n0 + get<1>(cS(r, c));
        if (j < lo || j >= hi) S(r, c) = -INFINITY;
      }
    }
  };

  // The scheduler barriers of kPingPong: a warp group's 128 threads sync on its own, the 128 of
  // the warp group before it (in a round) arrive.
  auto turn_begin = [&] {
    if constexpr (kPingPong) {
      cutlass::arch::NamedBarrier::sync(256, uint32_t(FwdBarrier::kSchedule0) + wg);
    }
  };
  auto turn_end = [&] {
    if constexpr (kPingPong) {
      cutlass::arch::NamedBarrier::arrive(
          256, uint32_t(FwdBarrier::kSchedule0) + (wg + 1) % kConsumerWarpGroups);
    }
  };

  // Rows of the first V tile past the keys that lie inside the tensor (TMA zero-fills the rows
  // past it, so a dense problem without seqused has none).  All consumers zero them once per
  // tile, at the same instruction (bar.sync is .aligned), before any wgmma reads the stage:
  // at the tile's start with kPerWarpGroupKeys (whose warp groups' paths differ later), else
  // under the first S = Q K^T, outside the turns.  So the key loop carries no zeroing code.
  // Paged, every row past the keys in the last tile is the page's own (Note [Keys in place]).
  const int v_tail =
      kCacheKeys && pages_in_place(kBlockN) && params.problem.kv.page_table != nullptr
          ? w.n_end * kBlockN - w.sk.len
          : min(w.n_end * kBlockN, int(get<0>(params.shape_k)) - w.sk.offset) - w.sk.len;
  auto zero_v_tail = [&] {
    pipeline_v.consumer_wait(read_v);  // the first key tile's V
    Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), SmemLayoutKV{});
    const int first = w.sk.len - (w.n_end - 1) * kBlockN;  // the stage's first row to zero
    constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks, contiguous in a swizzle
    for (int i = tid; i < v_tail * kChunksPerRow; i += kConsumerThreads) {
      Element* row =
          &sV(first + i / kChunksPerRow, (i % kChunksPerRow) * 8, read_v.index());
      *reinterpret_cast<uint4*>(row) = make_uint4(0, 0, 0, 0);
    }
    // The zeros are generic-proxy writes that wgmma (the async proxy) must see, in every
    // consumer warp group.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(FwdBarrier::kVTail));
  };
  auto wait_v = [&] { pipeline_v.consumer_wait(read_v); };
  // A key tile none of this warp group's rows sees: it only waits for the stages and frees them,
  // so that the pipelines (whose empty barriers count every consumer warp group) move on.
  auto skip = [&] {
    pipeline_k.consumer_wait(read_k);
    pipeline_k.consumer_release(read_k);
    ++read_k;
    wait_v();
    pipeline_v.consumer_release(read_v);
    ++read_v;
  };
  // The first S = Q K^T of a tile in turn (without kPingPong), so that the tensor cores run the
  // warp groups' first GEMMs one after the other and each one's first softmax runs under the
  // next one's GEMM (they start a tile together, on one Q barrier).  A warp group that skips
  // the block's first key tile takes its turn at once, issuing nothing.
  // A persistent block closes the round: warp group 0 waits for the last one's turn of the
  // previous tile (run() grants the first and takes the last).  Without the wait, warp group 0
  // could finish a short tile (causal, or one where another warp group's rows lie before the
  // sequence under kAlignLastTile) and arrive a second time on warp group 1's barrier before
  // warp group 1 took its turn of the first; a named barrier counts arrivals, not tiles, so
  // warp group 1's last sync would wait for an arrival that never comes.
  auto first_turn_begin = [&] {
    if constexpr (!kPingPong) {
      if (wg > 0 || kPersistent) {
        cutlass::arch::NamedBarrier::sync(256, uint32_t(FwdBarrier::kSchedule0) + wg);
      }
    }
  };
  auto first_turn_end = [&] {
    if constexpr (!kPingPong) {
      if (wg + 1 < kConsumerWarpGroups) {
        cutlass::arch::NamedBarrier::arrive(256, uint32_t(FwdBarrier::kSchedule0) + wg + 1);
      } else if constexpr (kPersistent) {
        cutlass::arch::NamedBarrier::arrive(256, uint32_t(FwdBarrier::kSchedule0));
      }
    }
  };

  if (w.n_begin < w.n_end) {
    // The key tiles [wg_begin, wg_end) that this warp group's rows see, within the block's
    // (empty: wg_begin = wg_end = n_begin).  Under a causal mask the warp groups of a tile see
    // different numbers of key tiles (hdim 64, 192 rows: a quarter fewer GEMMs at seqlen 512),
    // and a warp group whose rows lie past the sequence sees none (kPerWarpGroupKeys; without
    // it every warp group visits the block's key tiles).
    int wg_begin = w.n_begin, wg_end = w.n_end;
    if constexpr (kPerWarpGroupKeys) {
      int first, count;
      real_rows(wg_m0, 64, first, count);
      mask.key_block_range(first, count, kBlockN, wg_begin, wg_end);
      wg_begin = max(wg_begin, w.n_begin);
      wg_end = min(wg_end, w.n_end);
      if (wg_begin >= wg_end) wg_begin = wg_end = w.n_begin;
    }
    const bool lead = wg_end == w.n_end && wg_begin < wg_end;  // computes on the first key tile
    if constexpr (kPerWarpGroupKeys) {
      if (v_tail > 0) zero_v_tail();
    }
    if (wg == kConsumerWarpGroups - 1) turn_end();  // warp group 0 goes first
    if (!lead) {
      first_turn_begin();
      first_turn_end();
    }
    for (int n = w.n_end - 1; n >= wg_end; --n) skip();
    if (wg_begin < wg_end) {
      int n = wg_end - 1;
      pipeline_k.consumer_wait(read_k);
      turn_begin();
      if (lead) first_turn_begin();
      wgmma_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      if (lead) first_turn_end();
      turn_end();
      if constexpr (!kPerWarpGroupKeys) {
        if (v_tail > 0) zero_v_tail();
      }
      // The key tiles every score of which this warp group's rows see: one run, which the loop
      // below takes without the mask's code (kMaskFreeLoop; else it checks each tile).
      int full_begin, full_end, first, count;
      real_rows(wg_m0, 64, first, count);
      mask.all_visible_block_range(first, count, kBlockN, full_begin, full_end);
      auto all_visible = [&](int n_block) {
        return n_block >= full_begin && n_block < full_end;
      };
      warpgroup_wait<0>();
      pipeline_k.consumer_release(read_k);
      ++read_k;
      if (!all_visible(n)) apply_mask(n);
      softmax.template step<true>(S);
      convert_into(tOrP, tSrS);

      // Issues S_{n-1} = Q K_{n-1}^T and O += P_n V_n, and runs the softmax of S_{n-1}.
      // `masked` (a bool constant): S_{n-1} may need the mask; the tile is checked unless the
      // mask-free copy took every all-visible tile out.
      auto iteration = [&](auto masked) {
        pipeline_k.consumer_wait(read_k);
        if constexpr (kPingPong) wait_v();  // outside the turn
        turn_begin();
        wgmma_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        if constexpr (kRescaleUnderS) softmax.rescale(O);  // O is no GEMM's operand now
        if constexpr (!kPingPong) wait_v();  // while S's wgmma runs
        wgmma_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        turn_end();
        warpgroup_wait<1>();  // S_{n-1} is ready; P_n V_n may still run
        pipeline_k.consumer_release(read_k);
        ++read_k;
        if (decltype(masked)::value && (kMaskFreeLoop || !all_visible(n - 1))) apply_mask(n - 1);
        softmax.template step<false>(S);
        warpgroup_wait<0>();
        pipeline_v.consumer_release(read_v);
        ++read_v;
        if constexpr (!kRescaleUnderS) softmax.rescale(O);
        convert_into(tOrP, tSrS);
      };
      if constexpr (kMaskFreeLoop) {
        // Masked tiles (the diagonal, a partial last tile), the all-visible run, then masked
        // ones again (a left window bound): the outer loop runs at most twice.
        while (n > wg_begin) {
          for (; n > wg_begin && !all_visible(n - 1); --n) iteration(cute::true_type{});
          for (; n > wg_begin && all_visible(n - 1); --n) iteration(cute::false_type{});
        }
      } else {
        for (; n > wg_begin; --n) iteration(cute::true_type{});
      }
      // Every S = Q K^T of the tile has run: Q's buffer may take the next tile's Q while the
      // last P V and the epilogue run (unless it stages O).
      if constexpr (kOSlabs) q_free.arrive();
      if constexpr (kRescaleUnderS) softmax.rescale(O);
      wait_v();
      turn_begin();
      wgmma_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      turn_end();
      if (wg == 0) turn_begin();  // matches the last warp group's first arrive
      warpgroup_wait<0>();
      pipeline_v.consumer_release(read_v);
      ++read_v;
    } else if constexpr (kOSlabs) {
      q_free.arrive();
    }
    for (int n = wg_begin - 1; n >= w.n_begin; --n) skip();
  } else if constexpr (kOSlabs) {
    q_free.arrive();
  }

  float lse[kRows];
  softmax.finish(O, p.softmax_scale, lse);
  epilogue(params, storage, w, tOrO, lse);
  if constexpr (kPersistent && !kOSlabs) q_free.arrive();
}

template <class ElementTag, int kHeadDim, class Config>
template <class TensorO, class TensorLse>
__device__ void FwdKernel<ElementTag, kHeadDim, Config>::epilogue(const Params& params,
                                                                  SharedStorage& storage,
                                                                  const Work& w, TensorO& tOrO,
                                                                  TensorLse& lse) {
  const FwdParams& p = params.problem;
  const int tid = threadIdx.x - 128;
  const int wg = tid / 128;
  const int m0 = w.m0;
  TiledMmaPV mma_pv;
  auto thr_pv = mma_pv.get_thread_slice(tid);

  // lse: the first thread of each row's quad writes it.
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(select<0, 1>(TileShapePV{})));
  Tensor cO = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
  float* lse_out = p.lse.ptr + w.batch * p.lse.batch_stride + w.head * p.lse.head_stride +
                   w.sq.offset + m0;
  if (get<1>(cO(0, 0)) == 0) {
#pragma unroll
    for (int r = 0; r < size<0>(cO); ++r) {
      const int row = get<0>(cO(r, 0));
      if (w.in_sequence(row)) lse_out[row] = lse[r];
    }
  }

  Tensor tOrOut = make_tensor_like<Element>(tOrO);
  convert_into(tOrOut, tOrO);
  // O: registers -> shared memory (stmatrix, this warp group's rows) -> global.
  Tensor sO = make_tensor(make_smem_ptr(o_buffer(storage)), SmemLayoutO{});  // (M, D)
  const bool leader = tid % 128 == 0;  // issues the warp group's TMA store
  // The warp group's copy-out of the previous tile has read its rows of the buffer.
  if constexpr (kSeparateO) {
    if (leader) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, uint32_t(FwdBarrier::kEpilogue0) + wg);
  }
  // In V's stages, O waits for every warp group's last P V (the previous tile's O had left
  // them before this tile's first V could load).
  if constexpr (kOInV) {
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(FwdBarrier::kVRead));
  }
  // kOInV: the warp group's O has left V's stages; the producer may load the next tile's V.
  auto o_read = [&] {
    if constexpr (kOInV) {
      if (leader) storage.barriers.barrier_o_read.arrive();
    }
  };
  auto copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
  auto thr_copy_o = copy_o.get_thread_slice(tid);
  Tensor tOrCopy = thr_copy_o.retile_S(tOrOut);
  Tensor tOsCopy = thr_copy_o.partition_D(sO);
  copy(copy_o, tOrCopy, tOsCopy);
  if constexpr (kOSlabs) {
    if (params.tma_store_o) {
      // The stmatrix writes (generic proxy) must be seen by the TMA store (async proxy).
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(128, uint32_t(FwdBarrier::kEpilogue0) + wg);
      if (leader) {
        // Rows past the sequence lie past the tensor's rows, columns past the head dim past its
        // columns: TMA writes neither.
        Tensor mO = params.tma_o.get_tma_tensor(params.shape_q);  // (rows, d, heads, batch)
        Tensor gO = [&] {
          if constexpr (Config::kAlignLastTile) {
            return local_tile(domain_offset(make_coord(m0 + wg * 64, _0{}),
                                            mO(_, _, w.head, w.batch)),
                              Shape<_64, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));
          } else {
            return local_tile(mO(_, _, w.head, w.batch), Shape<_64, Int<kHeadDim>>{},
                              make_coord(w.m_block * kConsumerWarpGroups + wg, _0{}));
          }
        }();
        Tensor sOSlab = make_tensor(make_smem_ptr(o_buffer(storage) + wg * 64 * kHeadDim),
                                    SmemLayoutOSlab{});
        auto [tOgO, tOsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{},
                                          group_modes<0, 2>(sOSlab), group_modes<0, 2>(gO));
        // kAlignLastTile: a warp group before the sequence stores nothing.
        if (!Config::kAlignLastTile || m0 + wg * 64 >= 0) copy(params.tma_o, tOsO, tOgO);
        tma_store_arrive();
        if constexpr (kOInV) tma_store_wait<0>();  // the store has read the slab
      }
      o_read();
      return;
    }
  }
  // The warp group's 64 rows are staged; only it reads them back.
  cutlass::arch::NamedBarrier::sync(128, uint32_t(FwdBarrier::kEpilogue0) + wg);

  constexpr int kChunksPerRow = kHeadDim / 8;
  Element* o = static_cast<Element*>(p.o.ptr) + w.batch * p.o.batch_stride +
               int64_t(w.sq.offset + m0) * p.o.row_stride + w.head * p.o.head_stride;
#pragma unroll 4
  for (int i = tid % 128; i < 64 * kChunksPerRow; i += 128) {
    const int row = wg * 64 + i / kChunksPerRow;
    const int col = (i % kChunksPerRow) * 8;
    if (w.in_sequence(row) && col < p.head_dim) {
      *reinterpret_cast<uint4*>(o + int64_t(row) * p.o.row_stride + col) =
          *reinterpret_cast<const uint4*>(&sO(row, col));
    }
  }
  if constexpr (kOInV) {
    // The reads (generic proxy) come before the next V's TMA writes (async proxy), and, through
    // a barrier of all consumers, before the next tile's zeroing of V rows (generic writes).
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, uint32_t(FwdBarrier::kVRead));
    o_read();
  }
}

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    fwd_kernel(const __grid_constant__ typename Kernel::Params params) {
  // sm_90a only (wgmma, setmaxnreg); the host pass sees an empty body.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) char smem[];
  Kernel::run(params, *reinterpret_cast<typename Kernel::SharedStorage*>(smem));
#elif defined(__CUDA_ARCH__)
  __trap();  // compiled for another arch by mistake: fail loudly, never leave out unwritten
#endif
}

}  // namespace flash_cuda::sm90
