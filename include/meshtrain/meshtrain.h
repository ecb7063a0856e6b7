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
// These are the entry points; the other installed headers are what they
// include. Everything else is internal to the library (src/).

// Joining a job, communicating, and what fails.
#include "meshtrain/comm/communicator.h"  // comm::Communicator: collectives, point to point, sub-groups
#include "meshtrain/comm/errors.h"        // PeerFailure, CommTimeout, MismatchError: a peer named
#include "meshtrain/comm/rendezvous.h"    // comm::init_from_env(): rank, world and the job's store
#include "meshtrain/util/error.h"         // ConfigError: bad input named before any communication

// The device mesh and each strategy, applied to a plain torch::nn::Module from outside.
#include "meshtrain/cp/parallelize.h"     // context parallelism: ring attention over the cp ranks
#include "meshtrain/cp/ring_attention.h"  // ring attention as a call, and the sequence sharding
#include "meshtrain/dp/ddp.h"             // dp::DistributedDataParallel (PyTorch's DDP), no_sync
#include "meshtrain/dp/master_dp.h"       // dp::MasterDataParallel: the master-based data parallelism
#include "meshtrain/dp/replicate.h"       // dp::replicate(module, dp_comm)
#include "meshtrain/ep/parallelize.h"     // expert parallelism for nn::ExpertParallel modules
#include "meshtrain/mesh/mesh.h"          // mesh::DeviceMesh, MeshLayout, MeshDims (named degrees)
#include "meshtrain/pp/pipeline.h"        // pp::pipeline: GPipe, 1F1B, interleaved
#include "meshtrain/tp/ops.h"             // Megatron's conjugate operations, for hand-written tp
#include "meshtrain/tp/parallelize.h"     // tp::parallelize(module, tp_comm, plan): tp and sequence parallelism
#include "meshtrain/zero/fully_shard.h"   // zero::fully_shard: ZeRO-3 / FSDP
#include "meshtrain/zero/zero.h"          // zero::ZeroRedundancyOptimizer: ZeRO-1 and 2

// Everything at once, with checkpoints that load on any layout.
#include "meshtrain/train/checkpoint.h"      // sharded, atomic checkpoints
#include "meshtrain/train/clip.h"            // the global gradient norm, counted once across the layout
#include "meshtrain/train/module_trainer.h"  // train::Trainer: a model on a mesh with every strategy

// Models, data and weights.
#include "meshtrain/data/sampler.h"        // which samples a step trains on, the same on every layout
#include "meshtrain/data/shard_writer.h"   // documents -> llm.c token shards
#include "meshtrain/data/tokenizer.h"      // GPT-2 BPE, SentencePiece, byte-level tokenizers
#include "meshtrain/io/weights.h"          // Hugging Face safetensors and llm.c weights, in and out
#include "meshtrain/models/checkpointing.h"  // activation checkpointing
#include "meshtrain/models/generate.h"     // generation with a cache of keys and values
#include "meshtrain/models/gpt.h"          // the built-in decoders' pieces
#include "meshtrain/models/llama.h"
#include "meshtrain/models/models.h"       // GPT, GPT-2, Llama, MoE: plain modules
#include "meshtrain/plan/planner.h"        // which layout fits and runs fastest
#include "meshtrain/train/token_shards.h"  // llm.c token shards as a dataset

// The version this program was compiled against.
#include "meshtrain/version.h"
