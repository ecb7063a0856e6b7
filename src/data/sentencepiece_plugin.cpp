// libmeshtrain_sentencepiece.so: libsentencepiece behind a C interface, loaded
// by libmeshtrain in a link-map namespace of its own (Note [SentencePiece in
// its own link-map namespace] in sentencepiece_plugin.h). It links nothing of
// meshtrain or libtorch.

#include "sentencepiece_plugin.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <exception>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

int report(MtSpmBytes error, void* context, const std::string& what) {
  error(context, what.data(), what.size());
  return 1;
}

// Runs `body`, turning a failed status or an exception into an error report.
template <typename Body>
int guarded(MtSpmBytes error, void* context, Body body) {
  try {
    const sentencepiece::util::Status status = body();
    return status.ok() ? 0 : report(error, context, status.ToString());
  } catch (const std::exception& e) {
    return report(error, context, e.what());
  } catch (...) {
    return report(error, context, "unknown exception in libsentencepiece");
  }
}

sentencepiece::SentencePieceProcessor& processor(void* handle) {
  return *static_cast<sentencepiece::SentencePieceProcessor*>(handle);
}

}  // namespace

extern "C" {

int mt_spm_load(const char* path, void** handle, MtSpmBytes error, void* error_context) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const int rc = guarded(error, error_context, [&] { return sp->Load(path); });
  if (rc != 0) {
    delete sp;
    return rc;
  }
  *handle = sp;
  return 0;
}

void mt_spm_free(void* handle) { delete static_cast<sentencepiece::SentencePieceProcessor*>(handle); }

int mt_spm_info(void* handle, int* vocab_size, int* unk_id, int* bos_id, int* eos_id) {
  const auto& sp = processor(handle);
  *vocab_size = sp.GetPieceSize();
  *unk_id = sp.unk_id();
  *bos_id = sp.bos_id();
  *eos_id = sp.eos_id();
  return 0;
}

int mt_spm_encode(void* handle, const char* text, size_t size, MtSpmIds out, void* context, MtSpmBytes error,
                  void* error_context) {
  std::vector<int> ids;
  const int rc = guarded(error, error_context, [&] { return processor(handle).Encode({text, size}, &ids); });
  if (rc == 0) out(context, ids.data(), ids.size());
  return rc;
}

int mt_spm_decode(void* handle, const int* ids, size_t size, MtSpmBytes out, void* context, MtSpmBytes error,
                  void* error_context) {
  std::string text;
  const int rc = guarded(error, error_context, [&] { return processor(handle).Decode(std::vector<int>(ids, ids + size), &text); });
  if (rc == 0) out(context, text.data(), text.size());
  return rc;
}

int mt_spm_train(const char* flags, MtSpmBytes error, void* error_context) {
  // The trainer logs its progress to std::cerr (this namespace's own); keep
  // it, and hand it back only when training fails.
  std::ostringstream log;
  std::streambuf* saved = std::cerr.rdbuf(log.rdbuf());
  const int rc = guarded(error, error_context, [&] { return sentencepiece::SentencePieceTrainer::Train(flags); });
  std::cerr.rdbuf(saved);
  if (rc != 0) {
    const std::string tail = log.str().size() > 2000 ? log.str().substr(log.str().size() - 2000) : log.str();
    report(error, error_context, "\nlibsentencepiece's log (end):\n" + tail);
  }
  return rc;
}

}  // extern "C"
