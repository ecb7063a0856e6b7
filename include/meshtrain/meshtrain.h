#pragma once
// meshtrain: every strategy of cluster training for a libtorch model, from
// C++. One include for everything a user's program needs (docs/library.md):
//
//   #include "meshtrain/meshtrain.h"
//   auto world = meshtrain::comm::init_from_env();   // torchrun / OpenMPI / Slurm variables
//   meshtrain::mesh::DeviceMesh mesh(world, meshtrain::mesh::MeshLayout(world->size(), meshtrain::mesh::MeshDims().tp(2)));
//   meshtrain::tp::parallelize(*model, mesh.tp(), plan);
//   auto ddp = meshtrain::dp::replicate(model, mesh.dp());
//
// One header per layer, bottom up; everything else is internal to the
// library (src/).
#include "meshtrain/util.h"    // ConfigError: bad input named before any communication; seeds, JSON
#include "meshtrain/comm.h"    // comm::init_from_env(), Communicator; PeerFailure, CommTimeout, MismatchError
#include "meshtrain/mesh.h"    // mesh::DeviceMesh, MeshLayout, MeshDims (named degrees)
#include "meshtrain/nn.h"      // norms, rotary, attention, experts: layers free of parallelism
#include "meshtrain/dp.h"      // dp::replicate, DistributedDataParallel (PyTorch's DDP, no_sync), master DP
#include "meshtrain/zero.h"    // zero::fully_shard (ZeRO-3 / FSDP), ZeroRedundancyOptimizer (ZeRO-1 and 2)
#include "meshtrain/pp.h"      // pp::pipeline: GPipe, 1F1B, interleaved
#include "meshtrain/tp.h"      // tp::parallelize(module, tp_comm, plan): tp and sequence parallelism
#include "meshtrain/cp.h"      // cp::parallelize: ring attention over the cp ranks
#include "meshtrain/ep.h"      // ep::parallelize: experts spread over the ep ranks
#include "meshtrain/moe.h"     // models::MoE: router, balance losses
#include "meshtrain/models.h"  // GPT, GPT-2, Llama: plain modules; activation checkpointing; generation
#include "meshtrain/data.h"    // tokenizers, the token shard writer, the sampler
#include "meshtrain/io.h"      // Hugging Face safetensors and llm.c weights, in and out
#include "meshtrain/train.h"   // datasets, token shards, checkpoints, clipping, train::Trainer
#include "meshtrain/plan.h"    // which layout fits and runs fastest
#include "meshtrain/version.h" // the version this program was compiled against
