# Writes OUT (build-info.cpp) with the source tree's git commit; run at every build by the prescope target
# (configure_file leaves the file untouched when the text is the same, so nothing recompiles then).
# Inputs: -DSOURCE_DIR=... -DOUT=... -DCOMPILER=... -DCUDA=... (text)
set(PRESCOPE_COMMIT "unknown")
set(PRESCOPE_COMMIT_DATE "")
find_package(Git QUIET)
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} -C "${SOURCE_DIR}" rev-parse --short=12 HEAD
                  OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
  if(rc EQUAL 0 AND commit)
    set(PRESCOPE_COMMIT "${commit}")
    execute_process(COMMAND ${GIT_EXECUTABLE} -C "${SOURCE_DIR}" status --porcelain --untracked-files=no
                    OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(dirty)
      string(APPEND PRESCOPE_COMMIT "-dirty")
    endif()
    execute_process(COMMAND ${GIT_EXECUTABLE} -C "${SOURCE_DIR}" log -1 --format=%cs
                    OUTPUT_VARIABLE PRESCOPE_COMMIT_DATE OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
endif()
configure_file("${SOURCE_DIR}/src/core/build-info.cpp.in" "${OUT}" @ONLY)
