// pagoda/python.h: a kernel library's extern "C" entry points as a Python extension module.
//
// Python calls a kernel hundreds of times per decode step, so the cost of one call matters:
// through ctypes a call with a dozen integer arguments costs ~2 us (argument conversion), more
// than the kernels themselves at decode sizes. This header turns each entry point into a
// METH_FASTCALL function of the module (~0.1 us plus ~20 ns an argument): integers and
// pointers arrive as Python ints (a pointer is a tensor's data_ptr(), None for null), floats as
// floats, and the call runs with the GIL released. The entry points keep their C linkage, so
// the same library still loads with ctypes (the tests call the variants built for other CPUs so).
//
// Usage, at the end of a kernel source:
//   PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_gemm_f32), PAGODA_FUNCTION(pagoda_gemm_bf16))
// The module's name comes from the build (-DPAGODA_MODULE_NAME=<name>, as pagoda.cpp_extension passes it).
//
// Kernel graphs (pagoda.cpp_extension.graph): while a capture is active on the calling thread, each call
// is also recorded as (invoker, arguments in 8-byte slots, which slots are pointers, the result), and a
// recorded program is replayed later by one C loop with no Python in between -- the CPU's counterpart
// of a CUDA graph for a decode step's few hundred small kernel calls. The recorder is a C struct that
// core's Python module owns and hands to every kernel module through a capsule when the module loads.
#pragma once

#if defined(PAGODA_MODULE_NAME)
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

namespace pagoda::graph {

// An entry point called with its arguments unpacked from 8-byte slots; returns its integer result (0 for others).
using Invoker = int64_t (*)(const uint64_t* slots);

// Layout shared with pagoda/cpp_extension/graph.py (ctypes); kAbi changes with it.
constexpr uint32_t kAbi = 1;
struct Recorder {
  uint32_t abi;
  int32_t active;  // non-zero while some thread captures (the Python side filters by thread)
  void (*record)(const void* function, Invoker invoker, const uint64_t* slots, int64_t count, uint64_t pointer_mask,
                 int64_t result);
  void (*name)(const void* function, const char* name);  // which entry point `function` (a call address) is
  int64_t (*replay)(const uint64_t* program, int64_t* result);
};

// This module's pointer to the recorder (set when the module loads); each kernel module has its own copy.
static Recorder* g_recorder = nullptr;

template <typename T>
uint64_t to_slot(T value) {
  if constexpr (std::is_pointer_v<T>) {
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(value));
  } else if constexpr (std::is_floating_point_v<T>) {
    const double wide = static_cast<double>(value);
    uint64_t bits;
    std::memcpy(&bits, &wide, sizeof bits);
    return bits;
  } else {
    return static_cast<uint64_t>(static_cast<int64_t>(value));
  }
}

template <typename T>
T from_slot(uint64_t slot) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<uintptr_t>(slot));
  } else if constexpr (std::is_floating_point_v<T>) {
    double wide;
    std::memcpy(&wide, &slot, sizeof wide);
    return static_cast<T>(wide);
  } else {
    return static_cast<T>(static_cast<int64_t>(slot));
  }
}

// Only integer results (statuses, "handled" flags) are compared at replay; others record as 0.
template <typename R>
int64_t to_result(R value) {
  if constexpr (std::is_integral_v<R>) {
    return static_cast<int64_t>(value);
  } else {
    (void)value;
    return 0;
  }
}

// program: [count, then per call: invoker, expected result, slot count, slots...]. Returns -1 when every
// call returned what it returned at capture, else the index of the first that did not (its result in *result).
inline int64_t replay(const uint64_t* program, int64_t* result) {
  const int64_t count = static_cast<int64_t>(program[0]);
  const uint64_t* at = program + 1;
  for (int64_t i = 0; i < count; ++i) {
    const auto invoker = reinterpret_cast<Invoker>(static_cast<uintptr_t>(at[0]));
    const int64_t got = invoker(at + 3);
    if (got != static_cast<int64_t>(at[1])) {
      *result = got;
      return i;
    }
    at += 3 + at[2];
  }
  return -1;
}

// Called from the module's init: false (a Python error set) when core's recorder is missing or of another ABI.
inline bool attach(PyMethodDef* methods) {
  // PyCapsule_Import does not import submodules: load the one that owns the recorder first
  PyObject* owner = PyImport_ImportModule("pagoda.cpp_extension.graph");
  if (owner == nullptr) return false;
  Py_DECREF(owner);
  auto* recorder = static_cast<Recorder*>(PyCapsule_Import("pagoda.cpp_extension.graph._RECORDER", 0));
  if (recorder == nullptr) return false;
  if (recorder->abi != kAbi) {
    PyErr_Format(PyExc_ImportError, "pagoda kernel graph recorder ABI %u, this module was built for %u",
                 recorder->abi, kAbi);
    return false;
  }
  g_recorder = recorder;
  if (recorder->replay == nullptr) recorder->replay = &replay;
  for (PyMethodDef* m = methods; m->ml_name != nullptr; ++m)
    recorder->name(reinterpret_cast<const void*>(m->ml_meth), m->ml_name);
  return true;
}

}  // namespace pagoda::graph

namespace pagoda::python {

// One argument converted to the entry point's parameter type; false (a Python error set) when it does not convert.
template <typename T>
bool convert(PyObject* object, T& out) {
  if constexpr (std::is_pointer_v<T>) {
    if (object == Py_None) {
      out = nullptr;
      return true;
    }
    out = static_cast<T>(PyLong_AsVoidPtr(object));
  } else if constexpr (std::is_floating_point_v<T>) {
    out = static_cast<T>(PyFloat_AsDouble(object));
  } else {
    static_assert(std::is_integral_v<T>, "entry points take integers, floats and pointers");
    out = static_cast<T>(PyLong_AsLongLong(object));
  }
  return !PyErr_Occurred();
}

template <typename R>
PyObject* result(R value) {
  if constexpr (std::is_pointer_v<R>) {
    return PyBytes_FromString(value);  // const char*: a short C string
  } else if constexpr (std::is_floating_point_v<R>) {
    return PyFloat_FromDouble(value);
  } else {
    return PyLong_FromLongLong(static_cast<long long>(value));
  }
}

template <auto Fn>
struct Function;

template <typename R, typename... Args, R (*Fn)(Args...)>
struct Function<Fn> {
  static PyObject* call(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != static_cast<Py_ssize_t>(sizeof...(Args))) {
      PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", static_cast<int>(sizeof...(Args)), nargs);
      return nullptr;
    }
    return unpack(args, std::index_sequence_for<Args...>{});
  }

 private:
  template <size_t... I>
  static PyObject* unpack(PyObject* const* args, std::index_sequence<I...>) {
    std::tuple<std::decay_t<Args>...> values;
    if (!(convert(args[I], std::get<I>(values)) && ...)) return nullptr;
    // The kernel touches no Python object: other threads (the server's event loop) run meanwhile.
    PyThreadState* state = PyEval_SaveThread();
    if constexpr (std::is_void_v<R>) {
      Fn(std::get<I>(values)...);
      PyEval_RestoreThread(state);
      if (graph::g_recorder != nullptr && graph::g_recorder->active) record(values, 0, std::index_sequence<I...>{});
      Py_RETURN_NONE;
    } else {
      const R value = Fn(std::get<I>(values)...);
      PyEval_RestoreThread(state);
      if (graph::g_recorder != nullptr && graph::g_recorder->active)
        record(values, graph::to_result(value), std::index_sequence<I...>{});
      return result(value);
    }
  }

  static_assert(sizeof...(Args) <= 64, "a recorded call marks its pointer arguments in 64 bits");

  template <size_t... I>
  static void record(const std::tuple<std::decay_t<Args>...>& values, int64_t value, std::index_sequence<I...>) {
    const uint64_t slots[sizeof...(Args) + 1] = {graph::to_slot(std::get<I>(values))..., 0};
    uint64_t pointers = 0;
    ((pointers |= (std::is_pointer_v<std::decay_t<Args>> ? uint64_t{1} << I : 0)), ...);
    graph::g_recorder->record(reinterpret_cast<const void*>(&call), &invoke, slots, sizeof...(Args), pointers, value);
  }

  static int64_t invoke(const uint64_t* slots) { return invoke_unpacked(slots, std::index_sequence_for<Args...>{}); }

  template <size_t... I>
  static int64_t invoke_unpacked([[maybe_unused]] const uint64_t* slots, std::index_sequence<I...>) {
    if constexpr (std::is_void_v<R>) {
      Fn(graph::from_slot<std::decay_t<Args>>(slots[I])...);
      return 0;
    } else {
      return graph::to_result(Fn(graph::from_slot<std::decay_t<Args>>(slots[I])...));
    }
  }
};

}  // namespace pagoda::python

#define PAGODA_FUNCTION(fn) \
  { #fn, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&pagoda::python::Function<&fn>::call)), METH_FASTCALL, nullptr }

#define PAGODA_CONCAT_(a, b) a##b
#define PAGODA_CONCAT(a, b) PAGODA_CONCAT_(a, b)
#define PAGODA_STRINGIFY_(a) #a
#define PAGODA_STRINGIFY(a) PAGODA_STRINGIFY_(a)

#define PAGODA_PYTHON_MODULE(...)                                                                              \
  static PyMethodDef pagoda_module_methods[] = {__VA_ARGS__, {nullptr, nullptr, 0, nullptr}};                  \
  static PyModuleDef pagoda_module_def = {PyModuleDef_HEAD_INIT, PAGODA_STRINGIFY(PAGODA_MODULE_NAME), nullptr, \
                                          -1, pagoda_module_methods, nullptr, nullptr, nullptr, nullptr};      \
  extern "C" __attribute__((visibility("default"))) PyObject* PAGODA_CONCAT(PyInit_, PAGODA_MODULE_NAME)() {      \
    if (!pagoda::graph::attach(pagoda_module_methods)) return nullptr;                                          \
    return PyModule_Create(&pagoda_module_def);                                                                 \
  }
#else
// Built without a module name (a plain C library, e.g. a test's variant for another CPU): no module.
#define PAGODA_PYTHON_MODULE(...)
#endif
