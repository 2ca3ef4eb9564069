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
#pragma once

#if defined(PAGODA_MODULE_NAME)
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

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
      Py_RETURN_NONE;
    } else {
      const R value = Fn(std::get<I>(values)...);
      PyEval_RestoreThread(state);
      return result(value);
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
  extern "C" __attribute__((visibility("default"))) PyObject* PAGODA_CONCAT(PyInit_, PAGODA_MODULE_NAME)() { return PyModule_Create(&pagoda_module_def); }
#else
// Built without a module name (a plain C library, e.g. a test's variant for another CPU): no module.
#define PAGODA_PYTHON_MODULE(...)
#endif
