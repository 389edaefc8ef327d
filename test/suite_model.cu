// The test files that compile the model: its layers' CPU and CUDA code, the parallel runtimes, checkpoints and
// the planner. They form one translation unit, so every kernel and every model template is compiled once for
// all of them rather than once per file, which was most of the test build's time. Each file keeps its helpers
// in a namespace named after it. A new test file goes here when it includes a header with kernels
// (llmc/gpt.cuh or a layer), otherwise in test/suite_tools.cu; the Makefile refuses a test file in neither.
#include "test/test_checkpoint.cu"
#include "test/test_commands.cu"
#include "test/test_context_parallel.cu"
#include "test/test_cuda_kernels.cu"
#include "test/test_cuda_model.cu"
#include "test/test_distributed.cu"
#include "test/test_failures.cu"
#include "test/test_fp8.cu"
#include "test/test_hf.cu"
#include "test/test_layers.cu"
#include "test/test_llama.cu"
#include "test/test_llama_parallel.cu"
#include "test/test_model_reference.cu"
#include "test/test_moe.cu"
#include "test/test_pipeline.cu"
#include "test/test_plan.cu"
#include "test/test_planner.cu"
#include "test/test_qwen3.cu"
#include "test/test_recompute.cu"
#include "test/test_reshard.cu"
#include "test/test_rmsnorm.cu"
#include "test/test_rope.cu"
#include "test/test_swiglu.cu"
#include "test/test_tensor_parallel.cu"
