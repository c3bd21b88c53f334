/* The example's pipeline-parallel mode (pipeline.c), entered from main.c when the command line
 * has --pipeline. */
#ifndef MNIST_PIPELINE_H
#define MNIST_PIPELINE_H

/* 1 when argv asks for pipeline parallelism (--pipeline). */
int mnist_pipeline_requested(int argc, char **argv);

/* Parses argv on its own terms and trains; returns the process's exit status. */
int mnist_pipeline_main(int argc, char **argv);

#endif
