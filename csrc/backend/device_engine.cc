#include "backend/device_engine.h"

#ifdef XIRANG_WITH_CUDA
#include "cuda/cuda_stage.h"
#endif

namespace xirang {

std::vector<at::Tensor> OpStage::bind(const std::vector<at::Tensor>& ts, bool copy_in, bool copy_out) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(bind(t, copy_in, copy_out));
  return out;
}

std::shared_ptr<OpStage> hostStage() {
  static const std::shared_ptr<OpStage> stage = std::make_shared<OpStage>();
  return stage;
}

DeviceEngines::DeviceEngines() = default;
DeviceEngines::~DeviceEngines() = default;

void DeviceEngines::configure(const EngineSetup& setup) {
#ifdef XIRANG_WITH_CUDA
  cuda_ = std::make_unique<cudastage::Engine>(setup);  // makes no CUDA call before its first op
#else
  (void)setup;
#endif
}

std::shared_ptr<OpStage> DeviceEngines::stageFor(const std::vector<at::Tensor>& tensors, bool device_link) {
  if (cuda_)
    for (const auto& t : tensors)
      if (t.defined() && t.is_cuda()) return cuda_->stage(device_link, tensors);
  return hostStage();
}

void DeviceEngines::abort(const std::string& why) {
  if (cuda_) cuda_->abort(why);
}

}  // namespace xirang
