/*
 * eps.h: the C API of EPS, the elastic parameter server.
 *
 * A framework's worker process joins a job (started by `eps up`, or hosted in
 * the process with eps_cluster_start), declares its tensors, and trains on
 * views of EPS's registered buffers: it writes gradients into the gradient
 * buffer, pushes them, and reads the next parameters from the parameter
 * buffer, without a copy on either side.
 *
 *   eps_worker *w;
 *   eps_worker_create(NULL, NULL, &w);            // EPS_CONTROL, EPS_JOB_SECRET(_FILE)
 *   eps_tensor_decl t[] = {{"fc.weight", 640, EPS_DTYPE_F32}, {"fc.bias", 10, EPS_DTYPE_F32}};
 *   eps_worker_join(w, t, 2);
 *   eps_tensor_info fc;  eps_worker_get_tensor(w, 0, &fc);   // fc.params, fc.grads
 *   for (...) {
 *       eps_iteration it;  eps_worker_begin(w, 0, &it);    // its samples, or it left
 *       ... compute the gradient into fc.grads from fc.params ...
 *       eps_worker_push_pull(w);                          // or the _start calls + wait
 *   }
 *   eps_worker_finish(w);  eps_worker_close(w);
 *
 * Errors: every call returns an eps_status; eps_status_string() names it and
 * eps_last_error() tells the calling thread's last failure in detail. No call
 * aborts the process, whatever its arguments (a panic inside is returned as
 * EPS_ERR_INTERNAL).
 *
 * Ownership and lifetime: handles (eps_worker, eps_cluster) are created by a
 * create/start call and released by a close call; after close, every call with
 * the handle (a second close included) returns EPS_ERR_INVALID_HANDLE. Strings
 * and arrays passed in are copied or read during the call only. Pointers
 * returned (buffers, tensor names) are owned by the worker and valid until
 * eps_worker_finish or eps_worker_close.
 *
 * Buffers: between a tensor's push and the completion of the push request its
 * gradient must not change; between a push and the completion of its pull the
 * parameters are being written by the servers and must not be read.
 *
 * Thread safety: every call may be made from any thread; calls on one handle
 * are serialized (a blocking call holds the handle until it returns).
 *
 * Blocking: getters, eps_request_test and the version and error calls never
 * wait. A worker's waits (eps_worker_create, _join, _begin while a change of
 * the workers is voted, _push_start for a landing slot's credit, _push_pull,
 * the sparse calls, _leave, _finish, _close until nothing is in flight, and
 * eps_request_wait with timeout 0) each end after at most the worker's
 * timeout (eps_worker_options.timeout_ms, default 120000 ms) with
 * EPS_ERR_TIMEOUT, or EPS_ERR_CONTROL / EPS_ERR_FABRIC when a peer is gone.
 * eps_request_wait and eps_cluster_wait take their own timeout (for
 * eps_cluster_wait, 0 waits for the job's end without a limit). eps_scale
 * waits up to 10 s for the control plane and up to 120 s for a scale event
 * under way. eps_cluster_start returns once the control plane listens.
 */

#ifndef EPS_H
#define EPS_H

/* Generated from crates/eps-capi by cbindgen (its header test): do not edit. */

#include <stddef.h>
#include <stdint.h>

/**
 * Major version: a change means an incompatible ABI.
 */
#define EPS_VERSION_MAJOR 0

/**
 * Minor version: additions only.
 */
#define EPS_VERSION_MINOR 2

/**
 * Patch version.
 */
#define EPS_VERSION_PATCH 0

/**
 * `EPS_VERSION_MAJOR * 10000 + EPS_VERSION_MINOR * 100 + EPS_VERSION_PATCH`,
 * as the header was generated: pass it to `eps_check_version`.
 */
#define EPS_VERSION (((EPS_VERSION_MAJOR * 10000) + (EPS_VERSION_MINOR * 100)) + EPS_VERSION_PATCH)

/**
 * The result of every call.
 */
typedef enum eps_status {
  /**
   * Success.
   */
  EPS_OK = 0,
  /**
   * An argument is out of range or malformed (a size, an index, a string).
   */
  EPS_ERR_INVALID_ARGUMENT = 1,
  /**
   * A pointer argument that must not be NULL is NULL.
   */
  EPS_ERR_NULL_POINTER = 2,
  /**
   * The handle is not one this library made, or it was closed.
   */
  EPS_ERR_INVALID_HANDLE = 3,
  /**
   * The call does not fit the handle's state (push before join, join
   * twice, a pull of a tensor not pushed in this iteration...).
   */
  EPS_ERR_STATE = 4,
  /**
   * No tensor has that name or index.
   */
  EPS_ERR_NOT_FOUND = 5,
  /**
   * This worker's tensor declaration differs from the job's.
   */
  EPS_ERR_MISMATCH = 6,
  /**
   * Nothing came in time.
   */
  EPS_ERR_TIMEOUT = 7,
  /**
   * The control plane refused a request or cannot be reached.
   */
  EPS_ERR_CONTROL = 8,
  /**
   * The data-plane transport failed (a server closed its connection...).
   */
  EPS_ERR_FABRIC = 9,
  /**
   * This worker does not contribute to the current iteration: it left the
   * job (a scale-down, or its lease ran out).
   */
  EPS_ERR_LEFT = 10,
  /**
   * Not supported by this build or this job.
   */
  EPS_ERR_UNSUPPORTED = 11,
  /**
   * The header the caller was compiled with does not match this library.
   */
  EPS_ERR_VERSION = 12,
  /**
   * A bug in the library (it was caught; the handle may be unusable).
   */
  EPS_ERR_INTERNAL = 13,
} eps_status;

/**
 * Element types.
 */
typedef enum eps_dtype {
  /**
   * IEEE binary32.
   */
  EPS_DTYPE_F32 = 0,
  /**
   * bfloat16.
   */
  EPS_DTYPE_BF16 = 1,
  /**
   * IEEE binary16.
   */
  EPS_DTYPE_F16 = 2,
} eps_dtype;

/**
 * A job hosted in this process (opaque).
 */
typedef struct eps_cluster eps_cluster;

/**
 * A worker of a job (opaque).
 */
typedef struct eps_worker eps_worker;

/**
 * The worker as a whole, after join.
 */
typedef struct eps_worker_info {
  /**
   * This worker's rank in the job.
   */
  uint32_t rank;
  /**
   * Tensors in the job's layout (indices `0..tensor_count`).
   */
  uint32_t tensor_count;
  /**
   * The job's element type.
   */
  enum eps_dtype dtype;
  /**
   * Elements of the flat parameter space (all tensors, with alignment).
   */
  uint64_t elements;
  /**
   * Bytes of each of the two buffers.
   */
  uint64_t bytes;
  /**
   * The flat parameter buffer (registered memory the servers write into).
   */
  void *params;
  /**
   * The flat gradient buffer (registered memory pushes read from).
   */
  void *grads;
  /**
   * The iteration the next push belongs to.
   */
  uint64_t iteration;
  /**
   * `job.steps` of the job's spec.
   */
  uint64_t steps;
  /**
   * `job.batch` of the job's spec (samples per worker per iteration).
   */
  uint32_t batch;
  /**
   * 1 when the job's servers publish the averaged gradient instead of
   * parameters (`optimizer.kind = "none"`: the framework's optimizer
   * steps); 0 when they run the optimizer.
   */
  int gradient_average;
  /**
   * `job.seed`: the servers' initial parameters are
   * `eps_initial_params(seed, ...)`.
   */
  uint64_t seed;
  /**
   * The transport this worker runs on: `"soft"`, `"shm"`, `"soft+shm"` (auto:
   * shm to servers on this host, soft to the others) or `"rdma"` (static).
   */
  const char *transport;
} eps_worker_info;

/**
 * One tensor of the job's layout.
 */
typedef struct eps_tensor_info {
  /**
   * Its name (owned by the worker handle; valid until it is closed).
   */
  const char *name;
  /**
   * Number of elements.
   */
  uint64_t elements;
  /**
   * First element in the flat buffers.
   */
  uint64_t offset;
  /**
   * Element type.
   */
  enum eps_dtype dtype;
  /**
   * Its parameters inside the parameter buffer.
   */
  void *params;
  /**
   * Its gradient inside the gradient buffer.
   */
  void *grads;
} eps_tensor_info;

/**
 * What `eps_worker_begin` tells of the current iteration.
 */
typedef struct eps_iteration {
  /**
   * The iteration.
   */
  uint64_t iteration;
  /**
   * 1 if this worker contributes to it; 0 if it left the job at this
   * boundary (it then calls `eps_worker_finish`).
   */
  int contributes;
  /**
   * Its position among the iteration's contributors (in rank order).
   */
  uint32_t contributor_index;
  /**
   * How many workers contribute to the iteration (the gradient average's
   * divisor).
   */
  uint32_t contributors;
  /**
   * First sample of its data partition: the iteration's samples are dealt
   * out in rank order, `batch` per contributor, so no sample of a data
   * epoch is skipped or seen twice while workers join and leave.
   */
  uint64_t sample_begin;
  /**
   * One past its last sample.
   */
  uint64_t sample_end;
} eps_iteration;

/**
 * A non-blocking push or pull in flight, completed by `eps_request_test` or
 * `eps_request_wait`. A plain value: copy it freely; it is released by the
 * call that reports it complete (testing it again is `EPS_ERR_INVALID_ARGUMENT`).
 */
typedef struct eps_request {
  /**
   * The worker it belongs to.
   */
  struct eps_worker *worker;
  /**
   * Its number within that worker (0 is never used).
   */
  uint64_t id;
} eps_request;

/**
 * Transfer statistics.
 */
typedef struct eps_worker_stats {
  /**
   * Gradient bytes pushed.
   */
  uint64_t pushed_bytes;
  /**
   * Parameter bytes pulled.
   */
  uint64_t pulled_bytes;
  /**
   * Nanoseconds from each iteration's first push to its last pull.
   */
  uint64_t comm_ns;
  /**
   * The iteration the next push belongs to.
   */
  uint64_t iteration;
} eps_worker_stats;

/**
 * Options of `eps_worker_create`. Initialize with `eps_worker_options_init`,
 * then set what differs: the library reads only the first `struct_size`
 * bytes, so a program built against an older header (a smaller struct)
 * keeps working, the fields it lacks taking their defaults.
 */
typedef struct eps_worker_options {
  /**
   * `sizeof(eps_worker_options)` as the caller knows it (set by init).
   */
  size_t struct_size;
  /**
   * The job secret; NULL: `EPS_JOB_SECRET`, else the file named by
   * `EPS_JOB_SECRET_FILE` (as `eps up` prints it). Copied by create.
   */
  const char *secret;
  /**
   * `"soft"` (verbs semantics over TCP), `"shm"` (shared memory with servers
   * on this host, run as this user, which must be on shm too), `"rdma"` (an
   * RDMA device; a library built without the `rdma` feature refuses it with
   * `EPS_ERR_UNSUPPORTED`) or `"auto"` (rdma when a device is usable, else
   * shm to servers on this host and soft to the others, per connection).
   * NULL: `EPS_TRANSPORT`, else auto. `eps_worker_info` says which.
   */
  const char *transport;
  /**
   * Milliseconds to wait for the control plane, the servers and each
   * transfer (0: 120000).
   */
  uint32_t timeout_ms;
  /**
   * The RDMA device (`"mlx5_0"`, `"rxe0"`); NULL: `EPS_RDMA_DEVICE`, else
   * the first device with an active port.
   */
  const char *rdma_device;
  /**
   * Its port, from 1; 0: `EPS_RDMA_PORT`, else its first active port.
   */
  uint32_t rdma_port;
  /**
   * The GID index; -1: `EPS_RDMA_GID_INDEX`, else the first RoCE v2 GID
   * with an IPv4 address.
   */
  int32_t gid_index;
} eps_worker_options;

/**
 * A tensor as a worker declares it at join.
 */
typedef struct eps_tensor_decl {
  /**
   * Its name, NUL-terminated UTF-8, unique in the model (copied by join).
   */
  const char *name;
  /**
   * Number of elements (at least 1).
   */
  uint64_t elements;
  /**
   * Element type (every tensor of a job has the same).
   */
  enum eps_dtype dtype;
} eps_tensor_decl;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * This library's version, encoded as `EPS_VERSION`.
 */
uint32_t eps_version(void);

/**
 * Checks that this library can serve a program compiled with the header of
 * version `header_version` (pass `EPS_VERSION`): the major versions must be
 * equal and the library's minor version at least the header's.
 */
enum eps_status eps_check_version(uint32_t header_version);

/**
 * A static, NUL-terminated English name of `status` (never NULL; an
 * unknown value gives "unknown status").
 */
const char *eps_status_string(uint32_t status);

/**
 * The calling thread's last failure in detail (which call, what and why);
 * an empty string after a call that succeeded. Owned by the library: valid
 * until this thread's next call.
 */
const char *eps_last_error(void);

/**
 * The initial values the servers give elements `first .. first + count` of
 * the flat parameter space of a job with seed `seed` (uniform in
 * [-0.01, 0.01), a pure function of seed and index), into `out`: a program
 * that trains the same model alone can start where EPS starts.
 *
 * # Safety
 * `out` has room for `count` floats.
 */
enum eps_status eps_initial_params(uint64_t seed, uint64_t first, float *out, size_t count);

/**
 * Starts a job inside this process: a control plane listening on `listen`
 * (`"IP:PORT"`, port 0 for any; NULL: `127.0.0.1:0`) for the job spec
 * `spec_toml` (TOML text, as `eps control --spec` reads; `[model] declare =
 * true` lets the first worker declare the tensors), and `job.servers`
 * servers on threads, with the job secret `secret`. Workers join it like any
 * job; `eps_cluster_get_address` tells where.
 *
 * # Safety
 * `spec_toml` and `secret` are NUL-terminated strings; `listen` is NULL or
 * one; `out` is writable.
 */
enum eps_status eps_cluster_start(const char *spec_toml,
                                  const char *listen,
                                  const char *secret,
                                  struct eps_cluster **out);

/**
 * Writes the control plane's address (`"IP:PORT"`, NUL-terminated) into
 * `buf` of `capacity` bytes (64 always suffice).
 *
 * # Safety
 * `buf` has room for `capacity` bytes.
 */
enum eps_status eps_cluster_get_address(struct eps_cluster *c, char *buf, size_t capacity);

/**
 * Waits until the hosted job has finished (every worker and server did), or
 * `timeout_ms` passed (`EPS_ERR_TIMEOUT`; 0 waits without a limit). A
 * control plane or server that failed is reported (`EPS_ERR_CONTROL`).
 */
enum eps_status eps_cluster_wait(struct eps_cluster *c, uint32_t timeout_ms);

/**
 * Stops the hosted control plane (servers then exit once they see it gone)
 * and releases the handle. Any later call with it returns
 * `EPS_ERR_INVALID_HANDLE`.
 */
enum eps_status eps_cluster_close(struct eps_cluster *c);

/**
 * Asks the control plane at `control` (NULL: `EPS_CONTROL`) to grow or
 * shrink a running BSP job, as `eps scale` does: `servers` and `workers`
 * are the wanted counts, negative to leave one as it is. Joining workers
 * take new ranks (up to `job.max_workers`) and start at the next iteration
 * boundary nobody has begun: create and join them after this call.
 * Counts past the bounds of every job (1024 servers, 64 worker ranks) are
 * refused (`EPS_ERR_INVALID_ARGUMENT`) before anything is asked. Blocks
 * while the worker change waits for a scale event under way (up to 120 s;
 * then `EPS_ERR_CONTROL`).
 *
 * # Safety
 * `control` is NULL or a NUL-terminated string; `secret` is NULL (the
 * environment, as for workers) or one.
 */
enum eps_status eps_scale(const char *control, const char *secret, int servers, int workers);

/**
 * The index of the sparse table named `name` (what the other `eps_sparse_*`
 * calls take).
 *
 * # Safety
 * `name` is a NUL-terminated string; `table` is writable.
 */
enum eps_status eps_table_find(struct eps_worker *w, const char *name, uint32_t *table);

/**
 * The row dimension (values per row) of sparse table `table`.
 *
 * # Safety
 * `dim` is writable.
 */
enum eps_status eps_table_dim(struct eps_worker *w, uint32_t table, uint32_t *dim);

/**
 * Pulls the rows of `keys` (a key may repeat) as of the worker's current
 * iteration into `rows`: `rows_len` must be `count * dim` floats, row `i`
 * the row of `keys[i]`. Rows never seen are created by their servers from
 * the table's initializer.
 *
 * # Safety
 * `keys` points to `count` readable keys, `rows` to `rows_len` writable
 * floats (either may be NULL when its count is 0).
 */
enum eps_status eps_sparse_pull(struct eps_worker *w,
                                uint32_t table,
                                const uint64_t *keys,
                                size_t count,
                                float *rows,
                                size_t rows_len);

/**
 * Pulls the rows of `keys` as of the worker's current iteration into the
 * worker's own row buffer, one row per distinct key (copied out of the
 * registered buffer its servers write, so no copy by the caller): `*rows`
 * points to those rows (`*row_count` of them, `dim` floats each), and
 * `index[i]` is the row of `keys[i]`. The rows stay valid until the table's
 * next pull on this worker, or its close.
 *
 * # Safety
 * `keys` points to `count` readable keys and `index` to `count` writable
 * `uint32_t`s (NULL when `count` is 0); `rows` and `row_count` are writable.
 */
enum eps_status eps_sparse_pull_rows(struct eps_worker *w,
                                     uint32_t table,
                                     const uint64_t *keys,
                                     size_t count,
                                     uint32_t *index,
                                     const float **rows,
                                     size_t *row_count);

/**
 * Pushes the current iteration's gradient rows of `keys`: `grads_len` must
 * be `count * dim` floats, row `i` for `keys[i]` (a key may repeat: its
 * rows are summed in order). Once per table and iteration; returns when
 * the rows are on their way (see `eps_sparse_flush`). A table not pushed in
 * an iteration is pushed empty when the worker waits for its parameters.
 *
 * # Safety
 * `keys` points to `count` readable keys and `grads` to `grads_len`
 * readable floats (NULL when their count is 0).
 */
enum eps_status eps_sparse_push(struct eps_worker *w,
                                uint32_t table,
                                const uint64_t *keys,
                                size_t count,
                                const float *grads,
                                size_t grads_len);

/**
 * Waits until the servers applied this worker's last push of `table`.
 */
enum eps_status eps_sparse_flush(struct eps_worker *w, uint32_t table);

/**
 * The worker's rank, buffers and layout size.
 *
 * # Safety
 * `out` is writable.
 */
enum eps_status eps_worker_get_info(struct eps_worker *w, struct eps_worker_info *out);

/**
 * Tensor `index` of the job's layout, with its views of the buffers.
 *
 * # Safety
 * `out` is writable.
 */
enum eps_status eps_worker_get_tensor(struct eps_worker *w,
                                      uint32_t index,
                                      struct eps_tensor_info *out);

/**
 * The index of the tensor named `name`.
 *
 * # Safety
 * `name` is a NUL-terminated string; `index` is writable.
 */
enum eps_status eps_worker_find_tensor(struct eps_worker *w, const char *name, uint32_t *index);

/**
 * Begins the current iteration before its gradient is computed: waits while
 * a membership change is voted on at this boundary, and says whether this
 * worker contributes and which samples are its own (`batch` per
 * contributor; 0: the spec's `job.batch`).
 *
 * # Safety
 * `out` is writable.
 */
enum eps_status eps_worker_begin(struct eps_worker *w, uint64_t batch, struct eps_iteration *out);

/**
 * Pushes the gradients of tensors `tensor_ids` (`count` of them; NULL and 0:
 * every tensor not pushed yet in this iteration) without waiting: each shard
 * goes out once every tensor it overlaps was pushed. The request completes
 * when their gradient buffers may be written again. The first push of an
 * iteration begins it.
 *
 * # Safety
 * `tensor_ids` is NULL or points to `count` readable ids; `req` is writable.
 */
enum eps_status eps_worker_push_start(struct eps_worker *w,
                                      const uint32_t *tensor_ids,
                                      size_t count,
                                      struct eps_request *req);

/**
 * Asks for the next parameters of tensors `tensor_ids` (NULL and 0: all),
 * which must have been pushed in this iteration. The request completes when
 * they are in the parameter buffer; the iteration ends when every tensor's are.
 *
 * # Safety
 * As `eps_worker_push_start`.
 */
enum eps_status eps_worker_pull_start(struct eps_worker *w,
                                      const uint32_t *tensor_ids,
                                      size_t count,
                                      struct eps_request *req);

/**
 * `eps_worker_push_start` then `eps_worker_pull_start` of the same tensors,
 * as one request.
 *
 * # Safety
 * As `eps_worker_push_start`.
 */
enum eps_status eps_worker_push_pull_start(struct eps_worker *w,
                                           const uint32_t *tensor_ids,
                                           size_t count,
                                           struct eps_request *req);

/**
 * Pushes every tensor's gradient and waits for the next parameters.
 */
enum eps_status eps_worker_push_pull(struct eps_worker *w);

/**
 * Sets `*done` to 1 if `req` is complete (releasing it), else 0.
 *
 * # Safety
 * `req` points to a request this library filled in; `done` is writable.
 */
enum eps_status eps_request_test(const struct eps_request *req, int *done);

/**
 * Waits until `req` is complete (releasing it), or `timeout_ms` passed
 * (`EPS_ERR_TIMEOUT`; the request stays in flight). 0: the worker's timeout
 * (`eps_worker_options.timeout_ms`): the call never blocks longer than that.
 *
 * # Safety
 * `req` points to a request this library filled in.
 */
enum eps_status eps_request_wait(const struct eps_request *req, uint32_t timeout_ms);

/**
 * The contributors of `iteration` as far as this worker knows (as of its
 * last `eps_worker_begin`): up to `capacity` ranks into `ranks`, their
 * number into `*count` (which may exceed `capacity`).
 *
 * # Safety
 * `ranks` is NULL (with capacity 0) or has room for `capacity` ranks; `count` is writable.
 */
enum eps_status eps_worker_members(struct eps_worker *w,
                                   uint64_t iteration,
                                   uint32_t *ranks,
                                   size_t capacity,
                                   size_t *count);

/**
 * The first iteration after `after` at which the contributor set changes, as
 * far as this worker knows: compare `eps_worker_members` before and at it to
 * see who joined and who left. `EPS_ERR_NOT_FOUND` when no change is known.
 *
 * # Safety
 * `at` is writable.
 */
enum eps_status eps_worker_next_change(struct eps_worker *w, uint64_t after, uint64_t *at);

/**
 * Transfer statistics so far.
 *
 * # Safety
 * `out` is writable.
 */
enum eps_status eps_worker_get_stats(struct eps_worker *w, struct eps_worker_stats *out);

/**
 * Asks to leave the running job (BSP): the change is voted at the next
 * iteration boundary nobody has begun, and the other workers go on without
 * this one. Keep training until `eps_worker_begin` says it no longer
 * contributes, then call `eps_worker_finish`. Refused (`EPS_ERR_CONTROL`,
 * with the reason) for the last worker, or while another change is voted.
 */
enum eps_status eps_worker_leave(struct eps_worker *w);

/**
 * Tells the control plane this worker is done (at the end of training, or
 * after `eps_worker_begin` said it no longer contributes). The buffers stay
 * readable, holding the last parameters pulled, until `eps_worker_close`
 * (`eps_worker_get_info`, `_get_tensor`, `_find_tensor` and `_get_stats`
 * still work); nothing can be pushed or pulled.
 */
enum eps_status eps_worker_finish(struct eps_worker *w);

/**
 * Releases the worker. A worker closed without `eps_worker_finish` vanishes
 * from the job: it is removed when its lease runs out. Any later call with
 * the handle, a second close included, returns `EPS_ERR_INVALID_HANDLE`.
 * With the caller's buffers (`eps_worker_join_borrowed`) it first waits until
 * no pull or push is in flight; if that times out it returns
 * `EPS_ERR_TIMEOUT` and the worker stays open (the buffers are still in use).
 */
enum eps_status eps_worker_close(struct eps_worker *w);

/**
 * Gives the model's initial values, before `eps_worker_join`: every tensor
 * end to end in declaration order, in the job's element type (as in the
 * parameter buffer), `bytes` in all. They are copied now and checked at
 * join against the tensors (their size, and every value finite) before the
 * worker takes a rank. If this worker becomes rank 0 of a job whose servers
 * start from a worker's values (`model.init = "worker"`: the default for
 * a job whose tensors a framework declares), they are the job's first
 * parameters, and every worker's first pull returns them; otherwise the
 * first pull replaces them.
 *
 * # Safety
 * `values` is NULL or points to `bytes` readable bytes.
 */
enum eps_status eps_worker_set_initial(struct eps_worker *w, const void *values, size_t bytes);

/**
 * Sets every option to its default and `struct_size` to this header's size.
 *
 * # Safety
 * `opts` is NULL or points to writable memory for an `eps_worker_options`.
 */
enum eps_status eps_worker_options_init(struct eps_worker_options *opts);

/**
 * Creates a worker of the job whose control plane is at `control`
 * (`"HOST:PORT"`; NULL: the `EPS_CONTROL` environment variable). Nothing is
 * contacted until `eps_worker_join`.
 *
 * # Safety
 * `control` is NULL or a NUL-terminated string; `opts` is NULL (defaults) or
 * an initialized options struct; `out` is writable.
 */
enum eps_status eps_worker_create(const char *control,
                                  const struct eps_worker_options *opts,
                                  struct eps_worker **out);

/**
 * Joins the job: declares `tensors` (`count` of them; NULL and 0 when the
 * job's spec names its tensors), registers its buffers, connects to every
 * server and pulls the current parameters (a worker joining a running job
 * gets the parameters of the iteration it starts at). The first
 * declaration fixes a job's layout; a different one fails with
 * `EPS_ERR_MISMATCH`, naming the first difference in `eps_last_error`.
 *
 * # Safety
 * `tensors` is NULL or points to `count` declarations whose names are
 * NUL-terminated strings.
 */
enum eps_status eps_worker_join(struct eps_worker *w,
                                const struct eps_tensor_decl *tensors,
                                size_t count);

/**
 * As `eps_worker_join`, with parameter and gradient buffers the caller owns
 * (a framework's memory), registered in place instead of the library's:
 * `params` and `grads` each hold `bytes` bytes, which must be the sum of
 * the tensors' elements times the element size (tensors lie end to end in
 * declaration order). The parameters pulled at join overwrite `params`.
 *
 * # Safety
 * As `eps_worker_join`; and both buffers stay valid, and are not freed,
 * until `eps_worker_close` returned `EPS_OK` (it first waits until no pull
 * or push is in flight; servers write into `params` during a pull).
 */
enum eps_status eps_worker_join_borrowed(struct eps_worker *w,
                                         const struct eps_tensor_decl *tensors,
                                         size_t count,
                                         void *params,
                                         void *grads,
                                         size_t bytes);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* EPS_H */
