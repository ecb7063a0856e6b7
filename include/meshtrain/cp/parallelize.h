#pragma once
// cp::parallelize: context parallelism applied to a model from outside, its
// forward code left as it is (torchtitan's context_parallel, which swaps the
// attention function):
//
//   cp::parallelize(*model, mesh.cp());
//   auto x = cp::shard_sequence(tokens, 1, cp_size, cp_rank);   // this rank's two chunks
//   auto loss = loss_fn(model->forward(x), cp::shard_sequence(targets, 1, cp_size, cp_rank));
//
// Every nn::CausalAttention of the model (nn/sequence.h) then runs
// cp::ring_attention over `cp`, and every nn::Positions gives the positions
// of the rank's chunks (cp::local_positions), so a learned position table and
// rotary angles are read where the tokens sit; every layer with statistics
// over whole sequences (nn::TokenStatistics: a mixture of experts' balance
// loss) counts the cp group's tokens. The model's input is this rank's two
// chunks of every sequence (cp::shard_sequence along the sequence), the
// output its positions' predictions: each rank's loss is the mean over its
// tokens, and the gradients are averaged over the cp ranks as over data-
// parallel ones (the trainer's dp x cp group).
//
// A model whose attention is not an nn::CausalAttention would attend within
// each rank's chunks only and train wrong: refused. A cp of size 1 (or null)
// changes nothing. Apply once, before training.

#include <torch/nn/module.h>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace cp {

void parallelize(torch::nn::Module& model, const comm::CommPtr& cp);

}  // namespace cp
}  // namespace meshtrain
