#pragma once
// The C interface between libmeshtrain and libmeshtrain_sentencepiece.so, the
// plugin that holds the calls into Debian's libsentencepiece.
//
// Note [SentencePiece in its own link-map namespace]
// libsentencepiece.so.0 (Debian 0.1.97) carries its own copy of protobuf-lite
// 3.14 and exports those symbols, while libtorch loads libprotobuf.so.32
// (3.21). In one symbol scope they bind to each other: linked normally, the
// process dies at start-up inside libprotobuf's initializers (measured:
// SIGSEGV in ReflectionOps::FindInitializationErrors); dlopen'ed with
// RTLD_LOCAL, libsentencepiece binds to 3.21 and aborts ("compiled against
// 3.14.0 ... not compatible"); with RTLD_DEEPBIND it works only in programs
// without copy relocations of std::cout/std::cerr (a default PIE program
// crashes in the trainer's first log line). So libmeshtrain loads the plugin
// with dlmopen(LM_ID_NEWLM): a namespace of its own, with its own libstdc++
// and libc, where protobuf-lite 3.14 is the only protobuf. Nothing but plain
// C data crosses: the caller's buffers are read in place, and results come
// back through callbacks that copy them (memory is never freed across the
// boundary; exceptions never cross it).

#include <cstddef>

extern "C" {

// Receives `size` items (ids, or bytes of text or of an error message);
// `context` is the caller's.
typedef void (*MtSpmIds)(void* context, const int* ids, size_t size);
typedef void (*MtSpmBytes)(void* context, const char* data, size_t size);

// Each function returns 0 on success; otherwise it reports the error's text
// through `error` and returns nonzero.

// Loads a .model file; *handle is the processor (mt_spm_free releases it).
int mt_spm_load(const char* path, void** handle, MtSpmBytes error, void* error_context);
void mt_spm_free(void* handle);
// Vocabulary size and the unk, bos and eos ids (-1: absent).
int mt_spm_info(void* handle, int* vocab_size, int* unk_id, int* bos_id, int* eos_id);
int mt_spm_encode(void* handle, const char* text, size_t size, MtSpmIds out, void* context, MtSpmBytes error,
                  void* error_context);
int mt_spm_decode(void* handle, const int* ids, size_t size, MtSpmBytes out, void* context, MtSpmBytes error,
                  void* error_context);
// Runs the trainer with libsentencepiece's flag string ("--input=a,b --model_prefix=p ...").
int mt_spm_train(const char* flags, MtSpmBytes error, void* error_context);

}  // extern "C"
