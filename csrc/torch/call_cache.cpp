// The call cache of sageattn (sageattention2/_execute.py says what it is) looked up in C++: the
// kind of a call (shapes, dtypes and devices of q, k, v and the mask, whether autograd tracks
// it, and sageattn's other arguments with their types) read from the tensors without making a
// Python object, and the crossover's exact calls (exact SDPA on the caller's tensors, as
// called) run from here. In a model whose forward is host-bound (the UNets: 32-140 attention
// calls per forward, every one exact), the Python key and lookup cost 9-12 us per call in
// situ against 3 us in a tight loop (the model's own Python keeps them out of the caches), and
// that host time was the forward's (docs/DECISIONS.md#d37).
//
// Part of the Python module (setup.py's alone, like module.cpp): the op library of
// csrc/sources.txt has no Python in it.
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace sageattention2 {
namespace {

namespace py = pybind11;

// sageattn's arguments after q, k, v and attn_mask, in its order: the first four are SDPA's.
constexpr Py_ssize_t kOptions = 13;
constexpr size_t kMaxKinds = 1024;  // as _execute._MAX_RUNNERS: beyond, the cache starts afresh

// The kind of a call as a fixed array (no heap allocation per lookup): per tensor its rank, sizes,
// dtype and device (at most 4 dimensions each: a higher rank is not remembered, the Python path
// validates it), the mask's or -1, and the autograd flag.
constexpr size_t kMaxRank = 4, kKeyCapacity = 4 * (kMaxRank + 4) + 1;

struct Key {
  std::array<int64_t, kKeyCapacity> values{};
  size_t size = 0;

  void push_back(int64_t x) { values[size++] = x; }
  bool operator==(const Key& other) const {
    return size == other.size && std::equal(values.begin(), values.begin() + size, other.values.begin());
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = key.size;
    for (size_t i = 0; i < key.size; ++i)
      h ^= static_cast<size_t>(key.values[i]) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
  }
};

struct Entry {
  py::object options;               // the options tuple of the call that decided
  PyTypeObject* types[kOptions]{};  // and its elements' types (1 is not True to the validation)
  py::object runner;                // _execute's runner, called with SDPA's eight arguments
  bool exact_as_called = false;     // or exact SDPA on the caller's tensors, from here
  double dropout_p = 0.0;
  bool is_causal = false;
  std::optional<double> scale;
  bool enable_gqa = false;
};

std::unordered_map<Key, std::vector<Entry>, KeyHash>& kinds() {
  static auto* map = new std::unordered_map<Key, std::vector<Entry>, KeyHash>();  // never destroyed:
  return *map;  // its py::objects must not be released after the interpreter is gone
}

size_t& entry_count() {
  static size_t count = 0;
  return count;
}

// (The caller checked t.dim() <= kMaxRank.)
void append_tensor(Key& key, const at::Tensor& t) {
  key.push_back(t.dim());
  for (const int64_t s : t.sizes()) key.push_back(s);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(static_cast<int64_t>(t.device().type()));
  key.push_back(t.device().index());
}

// The kind of a call, or nothing for one the Python path must see: a tensor subclass or an
// active torch function mode (their __torch_function__ runs there), or not tensors at all.
std::optional<Key> call_kind(py::handle q, py::handle k, py::handle v, py::handle mask, py::handle options) {
  if (!THPVariable_CheckExact(q.ptr()) || !THPVariable_CheckExact(k.ptr()) || !THPVariable_CheckExact(v.ptr()) ||
      (!mask.is_none() && !THPVariable_CheckExact(mask.ptr())) || !PyTuple_CheckExact(options.ptr()) ||
      PyTuple_GET_SIZE(options.ptr()) != kOptions || at::impl::torch_function_mode_enabled())
    return std::nullopt;
  const at::Tensor& tq = THPVariable_Unpack(q.ptr());
  const at::Tensor& tk = THPVariable_Unpack(k.ptr());
  const at::Tensor& tv = THPVariable_Unpack(v.ptr());
  const at::Tensor* tmask = mask.is_none() ? nullptr : &THPVariable_Unpack(mask.ptr());
  for (const at::Tensor* t : {&tq, &tk, &tv, tmask})
    if (t != nullptr && t->dim() > static_cast<int64_t>(kMaxRank)) return std::nullopt;
  Key key;
  append_tensor(key, tq);
  append_tensor(key, tk);
  append_tensor(key, tv);
  if (tmask == nullptr) {
    key.push_back(-1);
  } else {
    append_tensor(key, *tmask);
  }
  key.push_back(at::GradMode::is_enabled() && (tq.requires_grad() || tk.requires_grad() || tv.requires_grad()));
  return key;
}

bool same_options(const Entry& e, PyObject* options) {
  for (Py_ssize_t i = 0; i < kOptions; ++i)
    if (Py_TYPE(PyTuple_GET_ITEM(options, i)) != e.types[i]) return false;
  const int equal = PyObject_RichCompareBool(e.options.ptr(), options, Py_EQ);
  if (equal < 0) {  // an option whose == raised: not this entry (the validation will name it)
    PyErr_Clear();
    return false;
  }
  return equal == 1;
}

// The result of a call of a kind remembered before, or `miss` (the Python path decides it).
py::object run_remembered(py::handle q, py::handle k, py::handle v, py::handle mask, py::handle options,
                          py::handle miss) {
  const std::optional<Key> key = call_kind(q, k, v, mask, options);
  if (!key) return py::reinterpret_borrow<py::object>(miss);
  const auto found = kinds().find(*key);
  if (found == kinds().end()) return py::reinterpret_borrow<py::object>(miss);
  for (const Entry& e : found->second) {
    if (!same_options(e, options.ptr())) continue;
    if (!e.exact_as_called) {  // (a reference of its own: the runner may let another thread clear the cache)
      const py::object runner = e.runner;
      return runner(q, k, v, mask, e.dropout_p, e.is_causal, e.scale, e.enable_gqa);
    }
    // Copies: once the GIL is released another thread may remember or clear (the entry moves).
    const at::Tensor tq = THPVariable_Unpack(q.ptr()), tk = THPVariable_Unpack(k.ptr()),
                     tv = THPVariable_Unpack(v.ptr());
    const std::optional<at::Tensor> attn_mask =
        mask.is_none() ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(mask.ptr()));
    const double dropout_p = e.dropout_p;
    const bool is_causal = e.is_causal, enable_gqa = e.enable_gqa;
    const std::optional<double> scale = e.scale;
    at::Tensor out;
    {
      py::gil_scoped_release no_gil;  // as SDPA's own binding
      out = at::scaled_dot_product_attention(tq, tk, tv, attn_mask, dropout_p, is_causal, scale, enable_gqa);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }
  return py::reinterpret_borrow<py::object>(miss);
}

// Remembers how calls of this kind run: `runner`, or with exact_as_called exact SDPA on the
// caller's tensors with the call's SDPA arguments. False where the call's kind is not one the
// cache keeps (call_kind).
bool remember(py::handle q, py::handle k, py::handle v, py::handle mask, py::handle options, py::object runner,
              bool exact_as_called) {
  std::optional<Key> key = call_kind(q, k, v, mask, options);
  if (!key) return false;
  Entry e;
  e.options = py::reinterpret_borrow<py::object>(options);
  PyObject* items = options.ptr();
  for (Py_ssize_t i = 0; i < kOptions; ++i) e.types[i] = Py_TYPE(PyTuple_GET_ITEM(items, i));
  e.runner = std::move(runner);
  e.exact_as_called = exact_as_called;
  // Validated already (the Python path remembers only what it ran): a real, bools, None or a real.
  e.dropout_p = py::cast<double>(PyTuple_GET_ITEM(items, 0));
  e.is_causal = PyObject_IsTrue(PyTuple_GET_ITEM(items, 1)) == 1;
  PyObject* scale = PyTuple_GET_ITEM(items, 2);
  if (scale != Py_None) e.scale = py::cast<double>(scale);
  e.enable_gqa = PyObject_IsTrue(PyTuple_GET_ITEM(items, 3)) == 1;
  if (entry_count() >= kMaxKinds) {
    kinds().clear();
    entry_count() = 0;
  }
  kinds()[std::move(*key)].push_back(std::move(e));
  ++entry_count();
  return true;
}

void forget_all() {
  kinds().clear();
  entry_count() = 0;
}

}  // namespace

void register_call_cache(py::module_& m) {
  py::module_ cache = m.def_submodule("call_cache", "sageattn's call cache, looked up in C++ (_execute)");
  cache.def("run", &run_remembered, "the result of a call of a kind remembered before, or `miss`",
            py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("options"), py::arg("miss"));
  cache.def("remember", &remember, "remember how calls of this kind run", py::arg("q"), py::arg("k"),
            py::arg("v"), py::arg("mask"), py::arg("options"), py::arg("runner"), py::arg("exact_as_called"));
  cache.def("clear", &forget_all, "forget every remembered call");
  cache.def("size", [] { return entry_count(); }, "how many kinds of calls are remembered");
}

}  // namespace sageattention2
