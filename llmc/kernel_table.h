// The kernels of one step, for --profile on a GPU: each kernel's name, its launches and its total GPU time, the
// longest first, from CUPTI's activity records (what PyTorch's profiler reads). CUPTI is opened with dlopen on
// first use, as cuBLASLt is (llmc/cuda_common.cuh): the binary does not link it, and a CPU run never loads it.
// CUPTI hands its records over in buffers we lend it, on a thread of its own, so the table they are summed into
// sits behind a mutex; a failure there cannot throw through CUPTI's C frames, so it is kept for
// kernel_table_stop() to report.
#pragma once

#include <cupti.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "llmc/cuda_common.cuh"  // find_symbol, cuda_check; fail and strfmt (llmc/utils.h)

struct KernelTime { std::string name; long launches = 0; double ms = 0; };

// The CUPTI functions used, looked up by name in the library of the CUPTI the code was compiled against.
struct CuptiApi {
    decltype(&cuptiGetVersion) get_version;
    decltype(&cuptiGetResultString) get_result_string;
    decltype(&cuptiActivityRegisterCallbacks) register_callbacks;
    decltype(&cuptiActivityEnable) enable;
    decltype(&cuptiActivityDisable) disable;
    decltype(&cuptiActivityFlushAll) flush_all;
    decltype(&cuptiActivityGetNextRecord) get_next_record;
};

inline CuptiApi open_cupti() {
    // its soname first, then the toolkit's own copies, for a machine whose loader path lacks the toolkit
    const char* names[] = {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/lib64/libcupti.so",
                           "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"};
    void* lib = nullptr;
    const char* soname = nullptr;
    for (const char* name : names)
        if (!lib && (lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) soname = name;
    if (!lib) fail("CUPTI: cannot open libcupti.so.13, libcupti.so or the toolkit's (/usr/local/cuda): %s", dlerror());
    CuptiApi api;
    auto find = [&](auto& function, const char* name) {
        if (!find_symbol(lib, function, name)) fail("CUPTI: %s has no %s", soname, name);
    };
    find(api.get_version, "cuptiGetVersion");
    find(api.get_result_string, "cuptiGetResultString");
    find(api.register_callbacks, "cuptiActivityRegisterCallbacks");
    find(api.enable, "cuptiActivityEnable");
    find(api.disable, "cuptiActivityDisable");
    find(api.flush_all, "cuptiActivityFlushAll");
    find(api.get_next_record, "cuptiActivityGetNextRecord");
    // a record's layout is its library's (CUPTI 12 writes CUpti_ActivityKernel9 where this header reads 10)
    uint32_t version = 0;
    if (api.get_version(&version) != CUPTI_SUCCESS || version / 10000 != CUPTI_API_VERSION / 10000)
        fail("CUPTI: %s is API version %u; this build reads CUPTI %d's records", soname, version,
             CUPTI_API_VERSION / 10000);
    return api;
}
inline const CuptiApi& cupti() {
    static const CuptiApi api = open_cupti();
    return api;
}

// "CUPTI: <call>: <CUPTI's text>", or "" on success
inline std::string cupti_error(CUptiResult result, const char* call) {
    if (result == CUPTI_SUCCESS) return "";
    const char* text = nullptr;
    if (cupti().get_result_string(result, &text) != CUPTI_SUCCESS || !text) text = "unknown error";
    return strfmt("CUPTI: %s: %s (%d)", call, text, (int)result);
}
inline void cupti_check(CUptiResult result, const char* call) {
    std::string error = cupti_error(result, call);
    if (!error.empty()) fail("%s", error.c_str());
}

struct KernelTableState {
    std::mutex mutex;                           // buffer_completed runs on a CUPTI thread
    std::map<std::string, KernelTime> kernels;  // by name
    std::string error;                          // the first failure inside a callback
};
inline KernelTableState& kernel_table_state() {
    static KernelTableState state;
    return state;
}

// CUPTI asks for a buffer to fill: 4 MiB holds some 20k kernel records; it asks again when that is full
inline void CUPTIAPI kernel_table_buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    const size_t bytes = 4 << 20;
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, bytes));
    *size = *buffer ? bytes : 0;
    *max_records = 0;  // as many as fit
    if (!*buffer) {    // CUPTI then drops records: the table would be short
        KernelTableState& state = kernel_table_state();
        std::lock_guard<std::mutex> lock(state.mutex);
        if (state.error.empty()) state.error = "CUPTI: cannot allocate an activity buffer: kernels were dropped";
    }
}

// CUPTI hands a filled buffer back: its kernels are added to the table, and the buffer is ours to free
inline void CUPTIAPI kernel_table_buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    KernelTableState& state = kernel_table_state();
    std::lock_guard<std::mutex> lock(state.mutex);
    CUpti_Activity* record = nullptr;
    for (;;) {
        CUptiResult result = cupti().get_next_record(buffer, valid, &record);
        // the end of the buffer, or an incomplete record, after which the docs say to stop
        if (result == CUPTI_ERROR_MAX_LIMIT_REACHED || result == CUPTI_ERROR_INVALID_KIND) break;
        if (result != CUPTI_SUCCESS) {
            if (state.error.empty()) state.error = cupti_error(result, "cuptiActivityGetNextRecord");
            break;
        }
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        std::string name = kernel->name ? kernel->name : "(unnamed)";
        if (name.size() > 120) name = name.substr(0, 117) + "...";  // templates' names run to thousands
        KernelTime& row = state.kernels[name];
        row.name = name;
        row.launches++;
        // start and end are 0 where CUPTI had no device memory to time the kernel: a launch, no time
        if (kernel->end > kernel->start) row.ms += (kernel->end - kernel->start) * 1e-6;
    }
    std::free(buffer);
}

// starts collecting the kernels that run from now on (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
inline void kernel_table_start() {
    // once per process: CUPTI keeps one pair of buffer callbacks
    static const CUptiResult registered =
        cupti().register_callbacks(kernel_table_buffer_requested, kernel_table_buffer_completed);
    cupti_check(registered, "cuptiActivityRegisterCallbacks");
    {
        std::lock_guard<std::mutex> lock(kernel_table_state().mutex);
        kernel_table_state().kernels.clear();
        kernel_table_state().error.clear();
    }
    // CONCURRENT_KERNEL, not KERNEL, which would serialize the kernels it times
    cupti_check(cupti().enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
}

// stops collecting, flushes CUPTI's buffers, and returns every kernel seen since start, summed by name, the longest
// first
inline std::vector<KernelTime> kernel_table_stop() {
    // the flush does not wait for the GPU: a kernel still running would come back without its times
    cuda_check(cudaDeviceSynchronize());
    cupti_check(cupti().disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable");
    cupti_check(cupti().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    KernelTableState& state = kernel_table_state();
    std::lock_guard<std::mutex> lock(state.mutex);
    if (!state.error.empty()) fail("%s", state.error.c_str());
    std::vector<KernelTime> table;
    for (auto& entry : state.kernels) table.push_back(entry.second);
    state.kernels.clear();
    // by time, then by name, so that equal rows come out in one order
    std::stable_sort(table.begin(), table.end(), [](const KernelTime& a, const KernelTime& b) { return a.ms > b.ms; });
    return table;
}
