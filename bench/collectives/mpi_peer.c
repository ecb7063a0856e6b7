/* OpenMPI's own collectives, timed by the protocol of main.cpp (meshtrain's
 * side of the comparison), so the two are comparable side by side: per op
 * and size, one untimed call, 5 warm-up calls, a calibration of the iteration
 * count to ~target seconds (agreed with an MPI_Allreduce MAX), a barrier, the
 * timed block; time per op = max over ranks. Sizes as in main.cpp: S = the
 * buffer (all_reduce, broadcast) or the full gathered / scattered buffer
 * (all_gather, reduce_scatter), float32. JSON with --out, as main.cpp writes.
 *
 *   mpirun -np 2 --mca btl self,vader build/bin/bench_mpi_peer --out r.json
 *   mpirun -np 2 --mca btl self,tcp build/bin/bench_mpi_peer     (TCP loopback)
 *
 * The impl name says which transport mpirun was told to use (OMPI_MCA_btl,
 * which mpirun's --mca btl sets in every rank's environment), or --impl. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { kMaxSizes = 32 };

typedef struct {
  const char* op;
  int per;   /* elements per rank (all_gather, reduce_scatter) */
  int numel; /* elements of the buffer (all_reduce, broadcast) */
  float* in;
  float* out;
  int* counts; /* all_to_all: per elements to and from each rank */
  int* displs;
} Call;

static void run_op(const Call* c) {
  if (strcmp(c->op, "all_reduce") == 0) {
    MPI_Allreduce(MPI_IN_PLACE, c->in, c->numel, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (strcmp(c->op, "all_gather") == 0) {
    MPI_Allgather(c->in, c->per, MPI_FLOAT, c->out, c->per, MPI_FLOAT, MPI_COMM_WORLD);
  } else if (strcmp(c->op, "reduce_scatter") == 0) {
    MPI_Reduce_scatter_block(c->in, c->out, c->per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (strcmp(c->op, "all_to_all") == 0) {
    MPI_Alltoallv(c->in, c->counts, c->displs, MPI_FLOAT, c->out, c->counts, c->displs, MPI_FLOAT, MPI_COMM_WORLD);
  } else {
    MPI_Bcast(c->in, c->numel, MPI_FLOAT, 0, MPI_COMM_WORLD);
  }
}

static double seconds_per_op(const Call* c, double target_s) {
  run_op(c);
  for (int i = 0; i < 5; ++i) run_op(c);
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  for (int i = 0; i < 3; ++i) run_op(c);
  double est = (MPI_Wtime() - t0) / 3;
  if (est < 1e-9) est = 1e-9;
  double want = target_s / est;
  long long iters = (long long)(want < 5 ? 5 : want > 5000 ? 5000 : want), agreed = 0;
  MPI_Allreduce(&iters, &agreed, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = MPI_Wtime();
  for (long long i = 0; i < agreed; ++i) run_op(c);
  double dt = (MPI_Wtime() - t0) / (double)agreed, slowest = 0;
  MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

/* "4K,64K,1M" -> bytes; returns the count. */
static int parse_sizes(const char* text, long long* sizes) {
  int n = 0;
  const char* p = text;
  while (*p && n < kMaxSizes) {
    char* end = NULL;
    long long v = strtoll(p, &end, 10);
    if (end == p) break;
    if (*end == 'K') v *= 1024, ++end;
    else if (*end == 'M') v *= 1024 * 1024, ++end;
    sizes[n++] = v;
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

static const char* default_impl(void) {
  const char* btl = getenv("OMPI_MCA_btl");
  if (btl && strstr(btl, "tcp") && !strstr(btl, "vader") && !strstr(btl, "sm")) return "OpenMPI (TCP)";
  return "OpenMPI (shared memory)";
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const char *sizes_arg = "4K,64K,1M,16M,64M", *ops_arg = "all_reduce,all_gather,reduce_scatter,broadcast";
  const char *out_path = NULL, *impl = default_impl();
  double target_s = 0.3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--sizes") == 0) sizes_arg = argv[i + 1];
    else if (strcmp(argv[i], "--ops") == 0) ops_arg = argv[i + 1];
    else if (strcmp(argv[i], "--target-s") == 0) target_s = atof(argv[i + 1]);
    else if (strcmp(argv[i], "--out") == 0) out_path = argv[i + 1];
    else if (strcmp(argv[i], "--impl") == 0) impl = argv[i + 1];
  }
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  long long sizes[kMaxSizes];
  const int nsizes = parse_sizes(sizes_arg, sizes);

  size_t json_cap = 4096, json_len = 0;
  char* json = malloc(json_cap);
  json_len += snprintf(json, json_cap, "{\"impl\": \"%s\", \"world_size\": %d, \"rows\": [", impl, world);
  int first = 1;
  char* ops = strdup(ops_arg);
  for (char* op = strtok(ops, ","); op; op = strtok(NULL, ",")) {
    for (int s = 0; s < nsizes; ++s) {
      Call c = {op, (int)(sizes[s] / 4 / world), (int)(sizes[s] / 4), NULL, NULL, NULL, NULL};
      c.counts = malloc(world * sizeof(int));
      c.displs = malloc(world * sizeof(int));
      for (int r = 0; r < world; ++r) c.counts[r] = c.per, c.displs[r] = r * c.per;
      const int in_elems = strcmp(op, "reduce_scatter") == 0 ? c.per * world : strcmp(op, "all_gather") == 0 ? c.per : c.numel;
      const int out_elems = strcmp(op, "all_gather") == 0 || strcmp(op, "all_to_all") == 0 ? c.per * world : c.per;
      c.in = calloc(in_elems > 0 ? in_elems : 1, sizeof(float));
      c.out = calloc(out_elems > 0 ? out_elems : 1, sizeof(float));
      const double t = seconds_per_op(&c, target_s);
      free(c.in);
      free(c.out);
      free(c.counts);
      free(c.displs);
      if (rank != 0) continue;
      printf("%s %lld B: %g us\n", op, sizes[s], t * 1e6);
      fflush(stdout);
      if (json_cap - json_len < 256) json = realloc(json, json_cap *= 2);
      json_len += snprintf(json + json_len, json_cap - json_len, "%s{\"op\": \"%s\", \"bytes\": %lld, \"sec_per_op\": %.9g}",
                           first ? "" : ", ", op, sizes[s], t);
      first = 0;
    }
  }
  if (rank == 0 && out_path) {
    FILE* f = fopen(out_path, "w");
    if (!f) {
      fprintf(stderr, "cannot write %s\n", out_path);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    fprintf(f, "%s]}\n", json);
    fclose(f);
  }
  free(ops);
  free(json);
  MPI_Finalize();
  return 0;
}
