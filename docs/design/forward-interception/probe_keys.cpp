// Which dispatch keys already have a backend fallback in libtorch 1.13?
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <iostream>
int main() {
  using K = c10::DispatchKey;
  for (K k : {K::Python, K::PythonTLSSnapshot, K::PythonDispatcher, K::Fake,
              K::FuncTorchDynamicLayerBackMode, K::FuncTorchDynamicLayerFrontMode,
              K::FuncTorchGradWrapper, K::FuncTorchBatched, K::DeferredInit,
              K::TESTING_ONLY_GenericWrapper, K::TESTING_ONLY_GenericMode,
              K::Functionalize, K::Named, K::Conjugate, K::Negative, K::ZeroTensor,
              K::ADInplaceOrView, K::AutogradCPU, K::AutogradPrivateUse1, K::Tracer, K::AutocastCPU, K::Batched, K::VmapMode,
              K::BackendSelect, K::PrivateUse1, K::CPU})
    std::cout << c10::toString(k) << " fallback=" << c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(k) << "\n";
}
