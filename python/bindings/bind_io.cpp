// Checkpoints, safetensors and config.json for Python. File I/O and header validation run
// with the GIL released; tensors come back as zero-copy views of the mapping.
#include <pybind11/stl.h>

#include <filesystem>
#include <memory>

#include "bindings.h"
#include "dflash2/error.h"
#include "dflash2/json.h"
#include "dflash2/safetensors.h"

namespace dflash2::py_bind {

namespace {

// str or os.PathLike -> a filesystem path string.
std::string fspath(const py::handle& obj) {
  py::object p = py::module_::import("os").attr("fspath")(obj);
  if (!py::isinstance<py::str>(p))
    fail(ErrorKind::InvalidArgument, "expected a str or os.PathLike path, found bytes");
  return p.cast<std::string>();
}

py::object json_to_python(const Json& j) {
  switch (j.type()) {
    case Json::Type::Null: return py::none();
    case Json::Type::Bool: return py::bool_(j.as_bool());
    case Json::Type::Number:
      if (j.is_int()) return py::int_(j.as_int());
      return py::float_(j.as_double());
    case Json::Type::String: return py::str(j.as_string());
    case Json::Type::Array: {
      py::list out;
      for (const auto& e : j.as_array()) out.append(json_to_python(e));
      return std::move(out);
    }
    case Json::Type::Object: {
      py::dict out;
      for (const auto& kv : j.as_object()) out[py::str(kv.first)] = json_to_python(kv.second);
      return std::move(out);
    }
  }
  return py::none();
}

std::string basename_of(const std::string& path) { return std::filesystem::path(path).filename().string(); }

py::dict info_dict(const TensorInfo& t, bool with_file) {
  py::dict d;
  d["dtype"] = dtype_name(t.dtype);
  py::list shape;
  for (auto s : t.shape) shape.append(s);
  d["shape"] = shape;
  if (with_file) d["file"] = basename_of(t.file);
  return d;
}

std::shared_ptr<Checkpoint> open_checkpoint(const py::handle& path) {
  std::string p = fspath(path);
  ReleaseGil nogil;
  return std::make_shared<Checkpoint>(Checkpoint::open(p));
}

}  // namespace

void bind_io(py::module_& m) {
  m.def(
      "inspect_checkpoint",
      [](py::handle path) {
        auto ck = open_checkpoint(path);
        py::dict out;
        for (const auto& kv : ck->all()) out[py::str(kv.first)] = info_dict(kv.second, true);
        return out;
      },
      py::arg("path"),
      "Validates a checkpoint (a .safetensors file or a directory) and returns "
      "{name: {'dtype', 'shape', 'file'}} sorted by name. Raises CheckpointError / ConfigError.");

  m.def(
      "parse_safetensors_bytes",
      [](py::buffer data, const std::string& name) {
        py::buffer_info buf = data.request();
        py::ssize_t expect = buf.itemsize;
        for (py::ssize_t i = buf.ndim - 1; i >= 0; --i) {
          if (buf.shape[size_t(i)] > 1 && buf.strides[size_t(i)] != expect)
            fail(ErrorKind::InvalidArgument, "parse_safetensors_bytes: argument 'data' must be a contiguous buffer");
          expect *= buf.shape[size_t(i)];
        }
        const auto* p = static_cast<const uint8_t*>(buf.ptr);
        size_t size = size_t(buf.size) * size_t(buf.itemsize);
        std::vector<TensorInfo> infos;
        {
          ReleaseGil nogil;
          infos = parse_safetensors(p, size, name);
        }
        py::dict out;
        for (const auto& t : infos) out[py::str(t.name)] = info_dict(t, false);
        return out;
      },
      py::arg("data"), py::arg("name") = "<bytes>",
      "Validates a whole safetensors image held in memory; returns {name: {'dtype', 'shape'}}.");

  m.def(
      "_parse_json",
      [](py::object text, int max_depth) {
        std::string s = text.cast<std::string>();  // str (as UTF-8), bytes or bytearray
        Json j;
        {
          ReleaseGil nogil;
          j = Json::parse(s, "<json>", ErrorKind::InvalidArgument, max_depth);
        }
        return json_to_python(j);
      },
      py::arg("text"), py::arg("max_depth") = 64,
      "The native strict JSON parser (for tests and fuzzing); raises InvalidArgumentError.");

  m.def(
      "load_config",
      [](py::handle path) {
        std::string p = fspath(path);
        Config c;
        {
          ReleaseGil nogil;
          std::error_code ec;
          if (std::filesystem::is_directory(p, ec)) p = (std::filesystem::path(p) / "config.json").string();
          c = Config::load(p);
        }
        return json_to_python(c.root());
      },
      py::arg("path"), "Reads config.json (or DIR/config.json) strictly; raises ConfigError.");

  py::class_<Checkpoint, std::shared_ptr<Checkpoint>>(
      m, "Checkpoint",
      "A validated checkpoint (one .safetensors file or a directory of shards). Tensors are "
      "zero-copy views of the mmap'ed files.")
      .def_static("open", &open_checkpoint, py::arg("path"))
      .def_property_readonly("path", &Checkpoint::path)
      .def("names", &Checkpoint::names, "Tensor names, sorted.")
      .def("has", &Checkpoint::has, py::arg("name"))
      .def("__contains__", &Checkpoint::has, py::arg("name"))
      .def("__len__", [](const Checkpoint& c) { return c.all().size(); })
      .def(
          "info",
          [](const Checkpoint& c, const std::string& name) {
            const TensorInfo& t = c.info(name);
            py::dict d = info_dict(t, true);
            d["path"] = t.file;
            d["data_offsets"] = py::make_tuple(t.begin, t.end);
            d["nbytes"] = t.end - t.begin;
            return d;
          },
          py::arg("name"), "{'dtype', 'shape', 'file', 'path', 'data_offsets', 'nbytes'} of one tensor.")
      .def(
          "tensor", [](const Checkpoint& c, const std::string& name) { return tensor_to_python(c.tensor(name)); },
          py::arg("name"), "A zero-copy dflash2_rt.Tensor view; it keeps the file mapped.")
      .def("config",
           [](const Checkpoint& c) -> py::object {
             if (!c.has_config()) return py::none();
             return json_to_python(c.config().root());
           },
           "config.json beside the weights as a dict, or None.")
      .def("files", &Checkpoint::files, "Full paths of the files holding the tensors, sorted.")
      .def_property_readonly("total_bytes", &Checkpoint::total_bytes)
      .def("__repr__", [](const Checkpoint& c) {
        return "dflash2_rt.Checkpoint('" + c.path() + "', " + std::to_string(c.all().size()) + " tensors, " +
               std::to_string(c.files().size()) + " files)";
      });
}

}  // namespace dflash2::py_bind
