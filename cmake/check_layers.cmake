# The include directions of the source tree, written once (docs/architecture.md explains them).
# Run by ctest (test `include_layers`): cmake -DSOURCE_DIR=<repo> -P cmake/check_layers.cmake
# Fails, listing every offending line, when a file includes a header of a layer above its own, of
# a sibling in its own layer, or of a directory that is in no layer.
#
# Layers, top to bottom. A file may include headers of its own directory and of any layer below
# its own; everyone may include the public headers (include/mixlens/*, spelled "mixlens/..."), and
# the public headers include only each other. Directories on one line are siblings: neither may
# include the other.
set(LAYERS
  "cli python/src"          # front ends: the CLI and the Python module
  "src/runtime"             # Model, Session, Trace, extraction: the public API's implementation
  "src/grad"                # the tape and the backwards (a family's, a mixer's, an op's)
  "src/models"              # the families: a small file each over a shared skeleton, the registry
  "src/mixers src/tokenizer" # one mixer per kind (forward and its kernels); the tokenizer
  "src/hooks"               # the listener interface and value serving shared by every forward
  "src/io"                  # config.json, safetensors, the weight store, the hub
  "src/ops"                 # tensors, kernels, threads, the arena, env settings
)
# No exceptions: every include goes down (issue 28). A family's backward is chosen in grad/ from
# the parts its skeleton exposes (models/family.h BackwardParts), so models/ needs no grad/ header.

if(NOT SOURCE_DIR)
  message(FATAL_ERROR "check_layers: pass -DSOURCE_DIR=<repository root>")
endif()

# directory -> layer index
set(dirs "")
set(index 0)
foreach(line IN LISTS LAYERS)
  string(REPLACE " " ";" members "${line}")
  foreach(d IN LISTS members)
    if(NOT IS_DIRECTORY "${SOURCE_DIR}/${d}")
      message(FATAL_ERROR "check_layers: layer directory '${d}' does not exist (update cmake/check_layers.cmake)")
    endif()
    set(layer_of_${d} ${index})
    list(APPEND dirs ${d})
  endforeach()
  math(EXPR index "${index} + 1")
endforeach()

# The directory an include names: "mixlens/x.h" is public; "a/x.h" is src/a unless a front end
# directory matches; a bare "x.h" is the including file's own directory.
set(violations "")
set(checked 0)
file(GLOB_RECURSE files RELATIVE "${SOURCE_DIR}"
     "${SOURCE_DIR}/src/*.h" "${SOURCE_DIR}/src/*.cpp" "${SOURCE_DIR}/cli/*.h" "${SOURCE_DIR}/cli/*.cpp"
     "${SOURCE_DIR}/python/src/*.h" "${SOURCE_DIR}/python/src/*.cpp" "${SOURCE_DIR}/include/*.h")
foreach(f IN LISTS files)
  get_filename_component(fdir "${f}" DIRECTORY)
  if(fdir MATCHES "^include(/|$)")
    set(flayer "public")
  elseif(DEFINED layer_of_${fdir})
    set(flayer ${layer_of_${fdir}})
  else()
    list(APPEND violations "${f}: its directory '${fdir}' is in no layer (add it to cmake/check_layers.cmake)")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  file(STRINGS "${SOURCE_DIR}/${f}" incs REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(inc IN LISTS incs)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\".*$" "\\1" h "${inc}")
    if(NOT h MATCHES "/")
      continue()  # own directory
    endif()
    string(REGEX MATCH "^[^/]+" top "${h}")
    if(top STREQUAL "mixlens")
      continue()  # the public headers
    endif()
    if(flayer STREQUAL "public")
      list(APPEND violations "${f}: includes \"${h}\"; a public header includes only mixlens/*")
      continue()
    endif()
    set(hdir "src/${top}")
    if(NOT DEFINED layer_of_${hdir})
      list(APPEND violations "${f}: includes \"${h}\" from '${hdir}', which is in no layer")
      continue()
    endif()
    if(hdir STREQUAL fdir)
      continue()
    endif()
    set(hlayer ${layer_of_${hdir}})
    if(hlayer GREATER flayer)
      continue()  # a lower layer
    endif()
    if(hlayer EQUAL flayer)
      list(APPEND violations "${f}: includes \"${h}\": '${hdir}' is a sibling of '${fdir}' (same layer)")
    else()
      list(APPEND violations "${f}: includes \"${h}\": '${hdir}' is a layer above '${fdir}'")
    endif()
  endforeach()
endforeach()

if(checked EQUAL 0)
  message(FATAL_ERROR "check_layers: no source file found under ${SOURCE_DIR}")
endif()
list(LENGTH violations n)
if(n GREATER 0)
  string(REPLACE ";" "\n  " text "${violations}")
  message(FATAL_ERROR "check_layers: ${n} include(s) against the layer order (cmake/check_layers.cmake):\n  ${text}")
endif()
message(STATUS "check_layers: ${checked} files, every include goes down a layer")
