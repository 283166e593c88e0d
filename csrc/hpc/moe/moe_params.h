// Parameters and workspace layout of the fused FP8 MoE pipeline
// stages (moe_route.cuh ... moe_reduce.cuh). Plain data: no torch, no device
// code beyond
// __host__ __device__ helpers.
#pragma once

#include <cstdint>

#include "common/elem_type.h"
#include "moe/moe_tiling.h"

namespace hpc {
namespace moe {

// The route stage's CTAs (moe_route.cuh): kRouteThreads threads, each
// taking kRouteSlotBatch of the CTA's kRouteSlotsPerCta consecutive slots.
constexpr int kRouteThreads = 256;
constexpr int kRouteSlotBatch = 4;
constexpr int kRouteSlotsPerCta = kRouteThreads * kRouteSlotBatch;

HPC_MOE_HD int64_t route_ctas(int64_t slots) {
  return ceil_div(slots, kRouteSlotsPerCta);
}

// Where each array lives in the flat workspace, for up to `max_tokens`
// tokens routed to `topk` experts each. The arrival counters come first, at
// a fixed place whatever the token count: they are zero when the workspace
// is created and every use returns them to zero.
struct MoeWorkspaceLayout {
  int64_t max_tokens;
  int topk;
  int num_experts;  // local experts
  int hidden;       // H
  int inter;        // I

  HPC_MOE_HD int64_t max_rows() const { return max_tokens * topk; }
  static HPC_MOE_HD int64_t align(int64_t bytes) {
    return (bytes + 255) / 256 * 256;
  }

  // int32 [num_experts, I / 128]: block-wise decode path, arrivals of the
  // gate-up CTAs of each expert's 128-column group.
  HPC_MOE_HD int64_t group_counters() const { return 0; }
  // int32 [num_experts + 1]: first sorted row of each expert.
  HPC_MOE_HD int64_t expert_offset() const {
    return group_counters() + align(4 * int64_t(num_experts) *
                                    ((inter + kScaleBlock - 1) / kScaleBlock));
  }
  // int32 [num_experts + 1]: first token tile of each expert.
  HPC_MOE_HD int64_t tile_offset() const {
    return expert_offset() + align(4 * (num_experts + 1));
  }
  // Token tiles over all experts, at most (tiles of kMinTokenTile rows).
  HPC_MOE_HD int64_t max_tile_infos() const {
    return (max_rows() + kMinTokenTile - 1) / kMinTokenTile + num_experts;
  }
  // TileInfo [max_tile_infos]: each token tile's expert and rows.
  HPC_MOE_HD int64_t tile_info() const {
    return tile_offset() + align(4 * (num_experts + 1));
  }
  // int32 [max_rows]: sorted row -> slot (token * topk + j).
  HPC_MOE_HD int64_t row_slot() const {
    return tile_info() + align(16 * max_tile_infos());
  }
  // int32 [max_rows]: slot -> sorted row, -1 if the expert is not local.
  HPC_MOE_HD int64_t slot_row() const {
    return row_slot() + align(4 * max_rows());
  }
  // int32 [route CTAs, num_experts]: each route CTA's rows per expert.
  HPC_MOE_HD int64_t route_counts() const {
    return slot_row() + align(4 * max_rows());
  }
  // fp8 [max_tokens, H]: the quantized input (16-bit inputs only).
  HPC_MOE_HD int64_t input_q() const {
    return route_counts() + align(4 * route_ctas(max_rows()) * num_experts);
  }
  // float [max_tokens, H / 128]: its scales (dynamic quantization only).
  HPC_MOE_HD int64_t input_scale() const {
    return input_q() + align(max_tokens * hidden);
  }
  // fp8 [max_rows, I]: SiLU(gate) * up, quantized.
  HPC_MOE_HD int64_t inter_q() const {
    return input_scale() + align(4 * max_tokens * (hidden / kScaleBlock));
  }
  // float [max_rows, I / 128]: its 1 x 128 scales (block-wise only).
  HPC_MOE_HD int64_t inter_scale() const {
    return inter_q() + align(max_rows() * inter);
  }
  // 16-bit [max_rows, H]: each routed row's down-projection output.
  HPC_MOE_HD int64_t down_rows() const {
    return inter_scale() +
           align(4 * max_rows() * ((inter + kScaleBlock - 1) / kScaleBlock));
  }
  // float [min(max_tokens, kDecodeMaxTokens) * topk, I]: the block-wise
  // decode path's SiLU(gate) * up per slot (token * topk + j), before its
  // 1 x 128 groups are quantized.
  HPC_MOE_HD int64_t decode_inter() const {
    return down_rows() + align(2 * max_rows() * hidden);
  }
  HPC_MOE_HD int64_t bytes() const {
    const int64_t decode_rows =
        (max_tokens < kDecodeMaxTokens ? max_tokens : kDecodeMaxTokens) * topk;
    return decode_inter() + align(4 * decode_rows * inter);
  }
};

// A float scale indexed by (row, k-block) for activations or by
// (expert, n-block, k-block) for weights; stride 0 broadcasts (per-tensor).
struct ScaleView {
  const float* ptr;
  int64_t s0;
  int64_t s1;
  int64_t s2;
  HPC_MOE_HD const float* address(int64_t i0, int64_t i1,
                                  int64_t i2 = 0) const {
    return ptr + i0 * s0 + i1 * s1 + i2 * s2;
  }
  HPC_MOE_HD float at(int64_t i0, int64_t i1, int64_t i2 = 0) const {
    return *address(i0, i1, i2);
  }
};

// One token tile of the grouped GEMMs, written by the route stage.
struct alignas(16) TileInfo {
  int expert;
  int row0;  // first expert-sorted row of the tile (-1: a slot tile)
  int rows;  // rows in the tile (<= the token tile)
  int unused;
};

struct MoeParams {
  int num_tokens;  // M
  int topk;
  int num_experts;  // local
  int hidden;       // H
  int inter;        // I
  bool block_wise;
  MoeTiling tiling;

  // Input [M, H]: 16-bit (quantized by the pipeline) or FP8.
  const void* input;
  int64_t input_stride;  // elements
  ElemType input_type;
  const float* a1_scale;    // static per-tensor scale, or FP8 input's scales
  int64_t a1_scale_stride;  // [M, H/128] FP8 block-wise input: row stride

  const uint8_t* w13;   // [E, 2I, H]
  ScaleView w13_scale;  // (expert, n-block, k-block)
  const uint8_t* w2;    // [E, H, I]
  ScaleView w2_scale;
  const float* a2_scale;  // static per-tensor intermediate scale

  const float* topk_weights;  // [M, topk]
  const void* topk_ids;       // [M, topk], global ids
  bool topk_ids_int64;
  const int32_t* expert_map;  // [global E] -> local or -1; null: offset
  int expert_offset;
  bool router_weight_on_input;

  const void* shared_output;  // [M, H] or null
  int64_t shared_stride;
  void* out;  // [M, H]
  int64_t out_stride;
  ElemType out_type;

  uint8_t* workspace;
  MoeWorkspaceLayout layout;
};

// Local expert of a routed slot (token * topk + j), or -1 when the expert
// is not on this rank.
HPC_MOE_HD int local_expert(const MoeParams& p, int slot) {
  const int64_t id = p.topk_ids_int64
                         ? static_cast<const int64_t*>(p.topk_ids)[slot]
                         : static_cast<const int32_t*>(p.topk_ids)[slot];
  const int e =
      p.expert_map ? p.expert_map[id] : static_cast<int>(id) - p.expert_offset;
  return e >= 0 && e < p.num_experts ? e : -1;
}

// On the grouped path 16-bit inputs are quantized by a stage of their own
// before the gate-up GEMM; FP8 inputs need none. (The decode path's gate-up
// kernel quantizes its token columns itself.)
HPC_MOE_HD bool quantize_stage_runs(const MoeParams& p) {
  return p.input_type != ElemType::kFp8E4m3;
}

}  // namespace moe
}  // namespace hpc
