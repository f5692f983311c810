// Command kstatus prints the status that sigs.k8s.io/cli-utils' kstatus computes for each
// Kubernetes object given as a YAML or JSON file: the rules Flux's health checks apply.
//
// Usage: kstatus FILE...
// Output: one JSON object per file, {"file": ..., "status": ..., "message": ...}.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/yaml"
)

type verdict struct {
	File    string `json:"file"`
	Status  string `json:"status"`
	Message string `json:"message"`
}

func compute(path string) (verdict, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return verdict{}, err
	}
	// Through JSON and unstructured's own decoder, so integers stay int64 as kstatus reads them.
	jsonData, err := yaml.YAMLToJSON(data)
	if err != nil {
		return verdict{}, fmt.Errorf("%s: %w", path, err)
	}
	obj := &unstructured.Unstructured{}
	if err := obj.UnmarshalJSON(jsonData); err != nil {
		return verdict{}, fmt.Errorf("%s: %w", path, err)
	}
	result, err := status.Compute(obj)
	if err != nil {
		return verdict{}, fmt.Errorf("%s: %w", path, err)
	}
	return verdict{File: path, Status: result.Status.String(), Message: result.Message}, nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kstatus FILE...")
		os.Exit(2)
	}
	out := json.NewEncoder(os.Stdout)
	for _, path := range os.Args[1:] {
		v, err := compute(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if err := out.Encode(v); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
}
