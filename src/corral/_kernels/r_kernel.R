# The R kernel, run by Rscript under python_driver.py (its source in CORRAL_R_KERNEL, which
# it unsets first; the protocol pipe's descriptor in CORRAL_R_PROTO). Cells come on stdin as a
# 12-digit byte count and the cell's UTF-8 source, and run in the global environment, so state
# stays across cells. What a cell says goes to the protocol pipe in frames of
# "<kind> <byte count>\n<bytes>" (no escaping for R to get wrong; the driver turns them into
# the host's JSON lines): "result" (the last expression's printed value, when visible),
# "display" (the path of a PNG the cell plotted), "error" (name, message and traceback,
# separated by NUL bytes) and "end". Output goes to fd 1 and 2, which the driver forwards;
# visible values of the cell's other top-level expressions print there, as at R's prompt.
local({
  proto <- file(sprintf("/proc/self/fd/%s", Sys.getenv("CORRAL_R_PROTO")), open = "wb")
  Sys.unsetenv(c("CORRAL_R_KERNEL", "CORRAL_R_PROTO"))
  input <- file("stdin", open = "rb")
  plots <- file.path(tempdir(), "corral-plots")
  dir.create(plots, showWarnings = FALSE)

  frame <- function(kind, bytes) {
    writeBin(c(charToRaw(sprintf("%s %d\n", kind, length(bytes))), bytes), proto)
    flush(proto)
  }
  utf8 <- function(text) charToRaw(enc2utf8(paste(text, collapse = "\n")))
  say_error <- function(name, value, traceback) {
    frame("error", c(utf8(name), as.raw(0), utf8(value), as.raw(0), utf8(traceback)))
  }
  read_exactly <- function(n) {
    got <- raw(0)
    while (length(got) < n) {
      more <- readBin(input, "raw", n - length(got))
      if (length(more) == 0) return(NULL)
      got <- c(got, more)
    }
    got
  }
  error_of <- function(e) {
    name <- class(e)[1]
    if (name %in% c("simpleError", "error")) name <- "Error"
    call <- conditionCall(e)
    call <- if (is.null(call)) "" else deparse(call, nlines = 1)[1]
    # A top-level stop()'s call is this kernel's eval: R's prompt says just "Error: ...".
    where <- if (call %in% c("", "eval(exprs[[i]], globalenv())")) "" else paste0(" in ", call)
    list(name = name, value = conditionMessage(e),
         traceback = paste0("Error", where, ": ", conditionMessage(e)))
  }

  run_cell <- function(code) {
    exprs <- tryCatch(parse(text = code, keep.source = FALSE), error = function(e) e)
    if (inherits(exprs, "error")) {
      message <- conditionMessage(exprs)
      say_error("SyntaxError", message, message)
      return(invisible())
    }
    last <- length(exprs)
    for (i in seq_len(last)) {
      ok <- withCallingHandlers(
        tryCatch({
          out <- withVisible(eval(exprs[[i]], globalenv()))
          if (out$visible) {
            if (i == last) {
              frame("result", utf8(utils::capture.output(print(out$value))))
            } else {
              print(out$value)
            }
          }
          TRUE
        }, error = function(e) {
          e <- error_of(e)
          say_error(e$name, e$value, e$traceback)
          FALSE
        }, interrupt = function(e) {
          say_error("KeyboardInterrupt", "", "KeyboardInterrupt")
          FALSE
        }),
        warning = function(w) {
          cat("Warning message:\n", conditionMessage(w), "\n", sep = "", file = stderr())
          invokeRestart("muffleWarning")
        })
      if (!ok) break
    }
  }

  # A cell's plots: the png device (cairo, no X11) writes each page to a file, and every
  # device still open at the cell's end is closed and its pages shown, as Jupyter's kernels do.
  frame("ready", raw(0))
  count <- 0
  repeat {
    header <- read_exactly(12)
    if (is.null(header)) break
    n <- as.integer(rawToChar(header))
    code <- if (n > 0) rawToChar(read_exactly(n)) else ""
    Encoding(code) <- "UTF-8"
    count <- count + 1
    cell_plots <- file.path(plots, sprintf("cell-%d", count))
    dir.create(cell_plots, showWarnings = FALSE)
    options(device = function(...) {
      grDevices::png(file.path(cell_plots, "plot-%03d.png"), width = 7, height = 5,
                     units = "in", res = 100, type = "cairo")
    })
    tryCatch(run_cell(code), interrupt = function(e) {
      say_error("KeyboardInterrupt", "", "KeyboardInterrupt")
    })
    while (!is.null(grDevices::dev.list())) try(grDevices::dev.off(), silent = TRUE)
    for (path in sort(list.files(cell_plots, full.names = TRUE))) frame("display", utf8(path))
    frame("end", raw(0))
  }
})
