// The test files that compile no kernels: the flags and runs through ./train_gpt, stopping runs and the launch
// scripts from outside, the multiple-choice evals and spike skipping, the tokenizer, the data loader, the
// pipeline schedules, and the safetensors and JSON files. One translation unit beside test/suite_model.cu
// (which says why), built in parallel with it.
#include "test/test_cli.cu"
#include "test/test_dataloader.cu"
#include "test/test_evals.cu"
#include "test/test_pp_schedules.cu"
#include "test/test_safetensors.cu"
#include "test/test_spikes.cu"
#include "test/test_stop.cu"
#include "test/test_tokenizer.cu"
